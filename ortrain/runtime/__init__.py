"""Executing training graphs with ONNX Runtime: sessions, bindings, persistent state."""
