"""helixserve.router"""
