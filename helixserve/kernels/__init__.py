"""helixserve.kernels"""
