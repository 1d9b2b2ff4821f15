"""helixserve.parallel"""
