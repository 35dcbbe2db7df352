"""Message quantization (codec) and adaptive bit-width assignment.

Names are resolved lazily from their submodules, so importing ``commsched.quant`` runs
nothing and pulls in neither the solver nor the kernels until they are used.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# name -> submodule, for the codec (stochastic quantization, packing, kernels dispatch)
_CODEC_EXPORTS: dict[str, str] = {
    "quantize": "codec",
    "dequantize": "codec",
    "QuantizedRows": "codec",
    "META_BYTES": "codec",
    "GroupLayout": "codec",
    "pack_groups": "codec",
    "unpack_groups": "codec",
    "message_bytes": "codec",
    "payload_bytes": "codec",
    "encode_signs": "codec",
    "decode_signs": "codec",
    "encode_records": "codec",
    "decode_records": "codec",
    "QuantRows": "rowwire",
    "quantized_all_reduce": "allreduce",
    "quantized_all_reduce_many": "allreduce",
    "GRAD_BITS": "allreduce",
}

# name -> submodule, for the bit-width assignment problem and its solvers
_ASSIGN_EXPORTS: dict[str, str] = {
    "MessageGroup": "widths.assign",
    "Channel": "widths.assign",
    "assign_bitwidths": "widths.assign",
    "BitwidthAssignment": "widths.assign",
    "assign_many": "widths.assign",
    "AssignmentProblem": "widths.assign",
    "evaluate_assignment": "widths.assign",
    "group_messages": "widths.assign",
    "expand_group_bits": "widths.assign",
}

_EXPORTS = {**_CODEC_EXPORTS, **_ASSIGN_EXPORTS}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
