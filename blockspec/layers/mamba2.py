"""Mamba-2 mixer with the three state disciplines an engine needs.

* extend (prefill, possibly chunked): chunked SSD scan from the request's committed state,
  writing the new state back;
* decode: one recurrent step per request, writing the state back;
* verify: T recurrent steps from the committed state that *do not* overwrite it; the inputs
  needed to rebuild the conv window and to replay the SSM recurrence (each step's decay,
  dt * x and B) go to the pool's verify scratch, from which ``MambaStatePool.commit_verify``
  advances the state to the last accepted index.

The torch code here is the reference (fp32 state and scan math). On CUDA, decode and verify
steps run as one Triton kernel per layer (``kernels/mamba_step.py``) that reads and writes the
state pool in place; ``forward_steps`` picks the path. A prefill's conv and chunked scan have
Triton kernels too (``kernels/causal_conv.py``, ``kernels/ssd_scan.py``), which ``extend``
takes wherever Triton runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.configs.nemotron_h import NemotronHConfig
from blockspec.kernels.causal_conv import causal_conv1d
from blockspec.kernels.mamba_step import mamba_steps
from blockspec.kernels.ssd_scan import ssd_scan
from blockspec.kernels.triton_loader import use_triton
from blockspec.layers.linear import QuantPlan, build_linear
from blockspec.layers.norm import GatedGroupRMSNorm
from blockspec.quant.linear import fused_input_scale


def ssd_chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, state: torch.Tensor, chunk: int, *,
                     return_chunk_states: bool = False):
    """Chunked SSD scan for sequences of equal length (the reference of ``kernels/ssd_scan``).

    x [Bt,T,H,P], dt [Bt,T,H] (after softplus), A [H], B/C [Bt,T,G,N] per group (G = H: per
    head; otherwise H/G consecutive heads share a group), state [Bt,H,P,N]. Returns y
    [Bt,T,H,P] (without the D skip) and the final state; fp32. With ``return_chunk_states``
    also the state after every chunk [Bt, ceil(T/chunk), H, P, N] (the last is the final one).
    """
    T, H = x.shape[1], x.shape[2]
    if B.shape[2] != H:
        B = B.repeat_interleave(H // B.shape[2], dim=2)
        C = C.repeat_interleave(H // C.shape[2], dim=2)
    ys, bounds = [], []
    S = state
    dA = dt * A
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        acum = torch.cumsum(dA[:, sl], dim=1)                         # [Bt,q,H]
        q = acum.shape[1]
        seg = acum[:, :, None, :] - acum[:, None, :, :]               # [Bt,l,s,H]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        # mask before exp: exp(-inf) = 0 exactly, and no inf above the diagonal whose
        # gradient (0 * inf) would poison training
        L = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
        xdt = x[:, sl] * dt[:, sl, :, None]                            # [Bt,q,H,P]
        G = torch.einsum("blhn,bshn->blsh", C[:, sl], B[:, sl])
        y = torch.einsum("blsh,bshp->blhp", G * L, xdt)
        y = y + torch.einsum("blhn,bhpn->blhp", C[:, sl], S) * torch.exp(acum)[..., None]
        decay = torch.exp(acum[:, -1:] - acum)                         # [Bt,q,H]
        S = (torch.exp(acum[:, -1])[:, :, None, None] * S
             + torch.einsum("bshn,bshp->bhpn", B[:, sl] * decay[..., None], xdt))
        ys.append(y)
        bounds.append(S)
    if return_chunk_states:
        return torch.cat(ys, dim=1), S, torch.stack(bounds, dim=1)
    return torch.cat(ys, dim=1), S


def recurrence_inputs(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step inputs of the recurrence S' = S * decay + (dt * x) B: decay = exp(dt * A)
    [..., H] and dt * x [..., H, P]. One place computes them, so a verify's stored inputs and
    its own steps are the same floats (elementwise kernels may round by tensor size)."""
    return torch.exp(dt * A), dt[..., None] * x


def ssm_recurrent_steps(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                        C: torch.Tensor, state: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step recurrence for a batch: x [Bt,T,H,P], dt [Bt,T,H], B/C [Bt,T,G,N] with
    G groups shared by H/G consecutive heads (G = H for per-head B/C), state [Bt,H,P,N].
    Returns y [Bt,T,H,P] (no D skip) and the states after each step [Bt,T,H,P,N]; the input
    state is not modified. Groups are broadcast, never copied per head."""
    Bt, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    S = state.reshape(Bt, G, H // G, P, N)
    decay_all, xdt_all = recurrence_inputs(x, dt, A)
    ys, states = [], []
    for t in range(T):
        decay = decay_all[:, t].reshape(Bt, G, -1, 1, 1)
        xdt = xdt_all[:, t].reshape(Bt, G, -1, P, 1)
        S = S * decay + xdt * B[:, t, :, None, None, :]
        ys.append(torch.einsum("bgrpn,bgn->bgrp", S, C[:, t]).reshape(Bt, H, P))
        states.append(S.reshape(Bt, H, P, N))
    return torch.stack(ys, dim=1), torch.stack(states, dim=1)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: NemotronHConfig, prefix: str, quant: QuantPlan | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.H, self.P, self.N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size
        self.G, self.K = cfg.n_groups, cfg.conv_kernel
        self.d_inner, self.conv_dim = cfg.d_inner, cfg.conv_dim
        self.chunk = cfg.chunk_size
        self.dt_limit = cfg.time_step_limit
        proj = self.d_inner + self.conv_dim + self.H
        self.in_proj = build_linear(f"{prefix}.in_proj", cfg.hidden_size, proj, cfg.use_bias, quant, dtype)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim,
                                bias=cfg.use_conv_bias, dtype=dtype)
        self.conv1d.requires_grad_(False)
        # SSM parameters stay fp32 whatever the model dtype: they feed exp/softplus.
        self.A_log = nn.Parameter(torch.zeros(self.H), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.H), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.H), requires_grad=False)
        self.norm = GatedGroupRMSNorm(self.d_inner, self.d_inner // self.G, cfg.layer_norm_epsilon, dtype)
        self.out_proj = build_linear(f"{prefix}.out_proj", self.d_inner, cfg.hidden_size, cfg.use_bias, quant, dtype)

    # ---- pieces --------------------------------------------------------------------------
    def input_fp8_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The scale at which the block's norm may hand ``forward_steps`` its input in E4M3
        (an FP8 in_proj with a static scale on the fused path), else None."""
        return fused_input_scale(self.in_proj, x)

    def _in(self, u: torch.Tensor) -> torch.Tensor:
        """in_proj of u, bf16 or already E4M3 (``input_fp8_scale``)."""
        if u.dtype == torch.float8_e4m3fn:
            return self.in_proj.forward_quantized(u, self.norm.weight.dtype)
        return self.in_proj(u)

    def _norm_out(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj(norm(y, z)); an FP8 out_proj gets its input quantized by the norm."""
        scale = fused_input_scale(self.out_proj, z)
        if scale is None:
            return self.out_proj(self.norm(y, z))
        return self.out_proj.forward_quantized(self.norm(y, z, fp8_scale=scale), z.dtype)

    def _split(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self._in(u)
        return p.split([self.d_inner, self.conv_dim, self.H], dim=-1)

    def _conv(self, xbc: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU. xbc [Bt,T,C], window [Bt,C,K-1] (previous inputs).
        A windowed weighted sum: for a width-4 depthwise filter this is a few elementwise
        kernels, far cheaper per step than a generic convolution call."""
        full = torch.cat([window.to(xbc.dtype), xbc.transpose(1, 2)], dim=2)    # [Bt,C,K-1+T]
        taps = full.unfold(2, self.K, 1)                                         # [Bt,C,T,K]
        out = (taps * self.conv1d.weight[:, 0, None, :]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias[:, None]
        return F.silu(out).transpose(1, 2)                                       # [Bt,T,C]

    def _ssm_inputs(self, xbc: torch.Tensor, dt_raw: torch.Tensor, upcast: bool = True):
        """x [..,H,P], B/C per group [..,G,N] (fp32, or views of xbc in its dtype unless
        ``upcast``), dt [..,H] after softplus (and clamp)."""
        x, Bm, Cm = (xbc.float() if upcast else xbc).split([self.d_inner, self.G * self.N, self.G * self.N], dim=-1)
        lead = x.shape[:-1]
        x = x.reshape(*lead, self.H, self.P)
        Bm = Bm.reshape(*lead, self.G, self.N)
        Cm = Cm.reshape(*lead, self.G, self.N)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        return x, Bm, Cm, dt

    def _out(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y + x * self.D.float()[:, None]
        y = y.reshape(*y.shape[:-2], self.d_inner)
        return self._norm_out(y, z)

    # ---- modes ---------------------------------------------------------------------------
    def extend(self, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill chunks of equal length u [Bt,T,d] from the committed states
        (conv [Bt,C,K-1], ssm [Bt,H,P,N]). Returns (out, new conv window, new ssm state).
        On CUDA the conv and the chunked scan are Triton kernels (``kernels/causal_conv.py``,
        ``kernels/ssd_scan.py``) reading the conv output in its own dtype; elsewhere
        ``_conv`` and ``ssd_chunked_scan``, their references. ``real`` [Bt,T] bool (a padded
        chunk: real rows first): padded rows get zero input and dt = 0, so the scan carries
        the state over them unchanged (decay exp(0) = 1, contribution 0), and the window is
        the last K - 1 real inputs."""
        z, xbc, dt_raw = self._split(u)
        fast = use_triton(u)
        if fast:
            conv_out, window = causal_conv1d(xbc, conv_state, self.conv1d.weight, self.conv1d.bias)
        else:
            conv_out = self._conv(xbc, conv_state)
            window = torch.cat([conv_state, xbc.transpose(1, 2).to(conv_state.dtype)],
                               dim=2)[..., -(self.K - 1):]
        if real is not None:
            window = self._real_window(xbc, conv_state, real)
            conv_out = torch.where(real[..., None], conv_out, 0)
        x, Bm, Cm, dt = self._ssm_inputs(conv_out, dt_raw, upcast=not fast)
        if real is not None:
            dt = torch.where(real[..., None], dt, 0.0)
        scan = ssd_scan if fast else ssd_chunked_scan
        y, final = scan(x, dt, -torch.exp(self.A_log.float()), Bm, Cm,
                        ssm_state if fast else ssm_state.float(), self.chunk)
        return self._out(y, x, z), window, final

    def _real_window(self, xbc: torch.Tensor, conv_state: torch.Tensor,
                     real: torch.Tensor) -> torch.Tensor:
        """The conv window after a padded chunk's real rows: inputs n-K+1 .. n-1 (n real rows
        per sequence), from the committed window where they reach before the chunk."""
        k1 = self.K - 1
        idx = real.sum(1, keepdim=True) - k1 + torch.arange(k1, device=xbc.device)   # [Bt,K-1]
        rows = xbc.gather(1, idx.clamp(min=0)[..., None].expand(-1, -1, xbc.shape[-1]))
        before = conv_state.gather(2, (idx + k1).clamp(max=k1 - 1)[:, None].expand(
            -1, conv_state.shape[1], -1))
        return torch.where((idx < 0)[:, None], before, rows.transpose(1, 2).to(conv_state.dtype))

    def forward_steps(self, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                      slots: torch.Tensor, steps: int, commit: bool,
                      xbc_scratch: torch.Tensor | None = None,
                      step_scratch: torch.Tensor | None = None) -> torch.Tensor:
        """``steps`` recurrent steps for each of B = len(slots) requests, ``u`` [B*steps, d] in
        row order b*steps + t, against one layer's state pools ([S, C, K-1], [S, H, P, N]).

        commit (decode): the slots' conv windows and SSM states advance in place.
        not commit (verify): the committed state is untouched; the pre-conv inputs and each
        step's recurrence inputs go to ``xbc_scratch`` [S, T', C] / ``step_scratch``
        [S, T', H + H*P + G*N] for ``MambaStatePool.commit_verify``. Returns the mixer output
        [B*steps, d]."""
        zxbcdt = self._in(u)
        z = zxbcdt[:, : self.d_inner]
        if use_triton(u) and self.K == 4:
            y = mamba_steps(zxbcdt, conv_weight=self.conv1d.weight, conv_bias=self.conv1d.bias,
                            dt_bias=self.dt_bias, a_log=self.A_log, d_skip=self.D,
                            conv_state=conv_state, ssm_state=ssm_state, slots=slots, steps=steps,
                            heads=self.H, head_dim=self.P, state_size=self.N, groups=self.G,
                            d_inner=self.d_inner, commit=commit, xbc_scratch=xbc_scratch,
                            step_scratch=step_scratch, dt_limit=self.dt_limit)
        else:
            y = self.steps_reference(zxbcdt, conv_state, ssm_state, slots, steps, commit,
                                     xbc_scratch, step_scratch)
        return self._norm_out(y, z)

    def steps_reference(self, zxbcdt: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, slots: torch.Tensor, steps: int, commit: bool,
                        xbc_scratch: torch.Tensor | None, step_scratch: torch.Tensor | None
                        ) -> torch.Tensor:
        """Torch reference of the fused step kernel: y [B*T, d_inner] fp32 (D skip included),
        with the same state writes."""
        B, T = slots.shape[0], steps
        _, xbc, dt_raw = zxbcdt.split([self.d_inner, self.conv_dim, self.H], dim=-1)
        xbc, dt_raw = xbc.reshape(B, T, -1), dt_raw.reshape(B, T, -1)
        window = conv_state[slots]
        conv_out = self._conv(xbc, window)
        x, Bm, Cm, dt = self._ssm_inputs(conv_out, dt_raw)
        y, states = ssm_recurrent_steps(x, dt, -torch.exp(self.A_log.float()), Bm, Cm,
                                        ssm_state[slots].float())
        y = y + x * self.D.float()[:, None]
        if commit:
            keep = conv_state.shape[-1]
            conv_state[slots] = torch.cat([window, xbc.transpose(1, 2).to(window.dtype)], dim=2)[..., -keep:]
            ssm_state[slots] = states[:, -1]
        else:       # the recurrence inputs ssm_recurrent_steps used, per position
            decay, dx = recurrence_inputs(x, dt, -torch.exp(self.A_log.float()))
            xbc_scratch[slots, :T] = xbc.to(xbc_scratch.dtype)
            step_scratch[slots, :T] = torch.cat([decay, dx.reshape(B, T, -1),
                                                 Bm.reshape(B, T, -1)], dim=-1)
        return y.reshape(B * T, self.d_inner)
