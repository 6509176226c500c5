"""rungs"""
