"""Decoders: one module per algorithm, all reached through `registry.decode`.

To follow one `ss` answer (Scaffold Speculative Decoding, paper 000 section 3.3), read four modules in order:

1. `registry`: `decode` checks the options against their one declaration (`options.ScaffoldSpeculativeOptions`),
   then runs `speculative.scaffold_speculative_decode` and measures it;
2. `speculative`: `Speculation` takes the paper's steps per section-aligned block (`blocks.section_blocks`):
   `auto_accept`, `draft` (the MDM head, `propose`), `verify` and `accept`;
3. `state`: the `Canvas` every decoder writes its answer on (ids, cache, the committed and cached lengths);
4. `acceptance`: the one acceptance rule, and the invariant that makes the answer greedy `ar`'s token for token.
"""

from fastddrive.decode.registry import DECODERS, LOSSLESS, DecoderError, decode, decoder_options
from fastddrive.decode.result import Decoded, DecodeResult

__all__ = ["DECODERS", "LOSSLESS", "DecodeResult", "Decoded", "DecoderError", "decode", "decoder_options"]
