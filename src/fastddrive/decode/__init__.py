"""Decoders: one module per algorithm, all reached through `registry.decode`."""

from fastddrive.decode.registry import DECODERS, LOSSLESS, DecoderError, decode, decoder_options
from fastddrive.decode.result import Decoded, DecodeResult

__all__ = ["DECODERS", "LOSSLESS", "DecodeResult", "Decoded", "DecoderError", "decode", "decoder_options"]
