"""helixserve.transceiver"""
