"""helixserve.kvcache"""
