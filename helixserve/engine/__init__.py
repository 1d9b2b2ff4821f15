"""helixserve.engine"""
