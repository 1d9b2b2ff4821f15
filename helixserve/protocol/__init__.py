"""helixserve.protocol"""
