"""helixserve.models"""
