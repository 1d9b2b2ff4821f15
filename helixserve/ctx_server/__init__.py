"""helixserve.ctx_server"""
