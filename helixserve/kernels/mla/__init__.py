"""MLA over a paged latent cache (absorbed form) and the helix lse combine."""
