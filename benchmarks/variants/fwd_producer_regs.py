"""Attention forward (Gluon, SM90): more registers for the producer warpgroup. The split-schedule probe of the
twenty-third session ran 7% faster with a 56-register producer than with 40 (its half-tile gathers spilled at 40);
does the shipped ping-pong's producer gain too? The first consumer gets the rest of the 64K registers.

Time on the GPU: ``python benchmarks/kernel_variants.py benchmarks/variants/fwd_producer_regs.py --T 32768 8192
--H 64 128 --flashmla .peers/flashmla``.
"""
_CFG = "FWD_CONFIG = dict(BLOCK_N=64, STAGES=2, REGS=(216, 40))"
VARIANTS = {
    "regs_216_56": [(_CFG, _CFG.replace("(216, 40)", "(216, 56)"))],
    "regs_232_56": [(_CFG, _CFG.replace("(216, 40)", "(232, 56)"))],
    "regs_216_48": [(_CFG, _CFG.replace("(216, 40)", "(216, 48)"))],
}
