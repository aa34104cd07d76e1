"""targets/cpu"""
