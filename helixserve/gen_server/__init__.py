"""helixserve.gen_server"""
