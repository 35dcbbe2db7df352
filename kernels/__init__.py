"""Triton GPU kernels (installed as ``commsched.kernels``). Each kernel names the torch reference it must equal."""
