"""Tiers and peers: the roots a manager saves to, peer-replicated local tiers, promotion of
local steps to the durable root, and retention.
"""
