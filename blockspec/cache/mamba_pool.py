"""Each Mamba layer's conv window and fp32 SSM state per request slot, plus the verify scratch
a speculative commit replays the accepted positions from."""
from __future__ import annotations

import torch

from blockspec.kernels.mamba_step import commit_verify
from blockspec.kernels.triton_loader import use_triton


class MambaStatePool:
    """Conv windows [L, slots, C, K-1] (model dtype) and SSM states [L, slots, H, P, N] (fp32).

    ``ensure_verify(T)`` adds the verify scratch: the pre-conv inputs [L, slots, T, C] and the
    recurrence inputs of each of T block positions [L, slots, T, H + H*P + G*N] (fp32: the
    decay exp(dt * A) per head, dt * x per channel, B per group). A verify forward writes them
    and leaves the committed state alone; ``commit_verify`` replays positions 0..a per row.
    Keeping a position's inputs rather than the state after it costs 1/N of the bytes (the
    verify writes no state at all), and the replay is the verify's own arithmetic.
    """

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, head_dim: int, state_size: int, dtype: torch.dtype,
                 device: torch.device, *, groups: int) -> None:
        if num_heads % groups or conv_dim < num_heads * head_dim + 2 * groups * state_size:
            raise ValueError(f"MambaStatePool: groups={groups} must divide num_heads={num_heads} "
                             f"and conv_dim={conv_dim} hold H*P + 2*G*N channels")
        self.groups = groups
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, num_heads, head_dim, state_size,
                               dtype=torch.float32, device=device)
        self.xbc_scratch: torch.Tensor | None = None
        self.step_scratch: torch.Tensor | None = None
        self.journal: list[tuple] | None = None     # see MemoryManager.record_device_ops

    @property
    def inputs_per_position(self) -> int:
        """Floats of one position's recurrence inputs: H + H*P + G*N."""
        _, _, H, P, N = self.ssm.shape
        return H + H * P + self.groups * N

    def ensure_verify(self, width: int) -> None:
        if self.step_scratch is not None and self.step_scratch.shape[2] >= width:
            return
        L, S, C, _ = self.conv.shape
        self.xbc_scratch = torch.zeros(L, S, width, C, dtype=self.conv.dtype, device=self.conv.device)
        self.step_scratch = torch.zeros(L, S, width, self.inputs_per_position, dtype=torch.float32,
                                        device=self.ssm.device)

    def reset(self, slot: int) -> None:
        if self.journal is not None:
            self.journal.append(("reset", slot))
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def commit_verify(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        """Every layer adopts the state after block position ``index[b]`` (0-based) for slot
        ``slots[b]``: the SSM state replays positions 0..index from the scratch's inputs; the
        conv window after position i is the last K-1 columns of [window | xbc[:i+1]]. Device
        ops only (graph-safe): one kernel for all layers on CUDA
        (``kernels/mamba_step.commit_verify``), else ``commit_verify_reference``."""
        if use_triton(self.ssm):
            commit_verify(self.conv, self.ssm, self.xbc_scratch, self.step_scratch, slots, index,
                          self.groups)
        else:
            self.commit_verify_reference(slots, index)

    def commit_verify_reference(self, slots: torch.Tensor, index: torch.Tensor) -> None:
        keep = self.conv.shape[-1]
        L, _, H, P, N = self.ssm.shape
        steps = self.step_scratch[:, slots]                                 # [L, B, W, F]
        B, W = steps.shape[1], steps.shape[2]
        decay = steps[..., :H]
        dx = steps[..., H:H + H * P].reshape(L, B, W, H, P)
        bm = steps[..., H + H * P:].reshape(L, B, W, self.groups, N)
        bm = bm.repeat_interleave(H // self.groups, dim=3)                  # [L, B, W, H, N]
        state = self.ssm[:, slots]
        for t in range(W):          # the update of ssm_recurrent_steps, op for op
            new = (state * decay[:, :, t, :, None, None]
                   + dx[:, :, t, :, :, None] * bm[:, :, t, :, None, :])
            state = torch.where((t <= index).view(1, B, 1, 1, 1), new, state)
        self.ssm[:, slots] = state
        full = torch.cat([self.conv[:, slots], self.xbc_scratch[:, slots].transpose(-1, -2)], dim=-1)
        cols = index[:, None] + 1 + torch.arange(keep, device=index.device)[None]      # [B, K-1]
        C = full.shape[2]
        window = full.gather(-1, cols[None, :, None, :].expand(L, B, C, keep))
        self.conv[:, slots] = window
