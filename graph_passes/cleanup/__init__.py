"""cleanup"""
