"""precision"""
