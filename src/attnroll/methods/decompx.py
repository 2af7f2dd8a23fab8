"""``decompx``: DecompX (Modarressi, Fayyaz, Aghazadeh, Yaghoobzadeh & Pilehvar, ACL 2023). Every token's
share of every hidden vector is carried through all blocks (attention, norms, the MLP with its activation
linearised per element) and through the head, so a token's score is its signed share of the target logit.
The token shares plus the bias share (``extra["bias_share"]``) add up to the target logit exactly.

Two rules for the biases (b_V, b_O, β, b_1, b_2, the head's):

* ``bias="separate"``, the default: every bias stays in the bias share (DecompX's bias token). With the
  coefficients frozen (attention, norm divisors, activation slopes) the network is then affine in the input
  embeddings, so the shares come exactly from one forward + one backward pass: ~3x an SDPA forward at
  ViT-B/16, batch 8 (BENCHMARKS.md). It is the default because it is ~65x cheaper than AbsDot and was as
  faithful on both of the project's benchmarks (EVALUATION.md: shapes deletion 0.159 vs 0.160, text
  comprehensiveness 0.574 vs 0.558). It runs under ``torch.no_grad()`` and ``torch.inference_mode()`` too
  (the backward pass is local: inference mode is left for it on copies of the tensors it saves).
* ``bias="absdot"``, the paper's rule: a bias joins each token's share in proportion to |b · s_k|. That is
  not affine in the shares, so every token's share is carried through every block, O(n) blocks' linear work
  (~190x a forward at ViT-B/16). In a padded batch this route carries each example's real tokens only
  (padded tokens' shares of real rows are 0 throughout; ~(n / n_real)² less work, same numbers).

``start_layer=l`` (default 0, the paper's DecompX; ``bias="separate"`` only) is our variant, not the paper's:
the decomposition starts at the vectors entering block l. With the coefficients frozen the logit is affine in
them, so token j's share there is ⟨∂y/∂x^l_j, x^l_j⟩ (the same one backward pass, from block l up), and
these shares are carried down to the input tokens through blocks l − 1, …, 0 by ``measured_rollout``'s
matrices M = diag(r) + diag(1 − r) · mean_h α^h (rows sum to 1: the tokens and the bias share still add up
to the logit). On the shapes benchmark's validation images l = 1 was more faithful than l = 0
(docs/research/value-aware-shapes.md): block 0 mixes each patch with its neighbours before any class evidence is read.

Heads that pool rows (timm ``global_pool='avg'`` with its ``fc_norm``, DINOv2's CLS ⊕ mean of the patch
rows) are decomposed as the layer anatomy describes them: every output row's shares through the final norm,
pooled, concatenated, then the classifier."""

from __future__ import annotations

import torch

from .. import _checks
from ..core.decompx import block_shares, head_shares, initial_shares, pool_shares, separate_bias_shares
from ..core.residual_share import measured_matrix
from ..core.value_aware import mlp_width, normalize_rows, with_rows
from ..explain import value_aware as va
from ..explain.context import Context
from ..explain.registry import register


def shares(ctx: Context, bias: str, dtype, start_layer=0) -> tuple:
    """(rec, positions, logit shares (B, n + 1): tokens then the bias share); ``start_layer`` l > 0: the
    shares are taken at block l's input and carried down by the measured-share matrices (module)."""
    _checks.check_choice("bias", bias, ("absdot", "separate"))
    start = _checks.check_int("start_layer", start_layer)  # its range [0, L − 1] once the model is recorded
    if start > 0 and bias != "separate":
        raise ValueError(
            f"start_layer: decompx starts above the input (start_layer={start}) only with bias='separate', got "
            f"bias={bias!r}: the shares at block l are the frozen-coefficient linear shares of one backward pass, "
            "which AbsDot's |b · s_k| split is not; use start_layer=0 with bias='absdot'"
        )
    rec, states, anat = va.record(ctx)
    # separate's backward pass needs autograd, which inference mode switches off; the arrays below are built
    # outside it (normal tensors) and the recorded ones copied where autograd saves them (_normal)
    with torch.inference_mode(False):
        dt = va.working_dtype(dtype, states.inputs[0])
        head = anat.head(dt)  # raises for a model without a head, before any work
        pos = ctx.positions(rec, "self")
        va.check_head_readout(ctx, rec, pos, "decompx")
        mask = ctx.mask(rec, "self")
        _check_real(mask, pos)
        classes = _normal(va.logit_classes(ctx, rec, "decompx", "decomposes one logit of the model's head"))
        x0 = _normal(states.inputs[0].to(dt))
        pos_t = torch.tensor(pos, device=x0.device)
        pools = anat.pool_weights(x0.shape[1], pos_t, dt) if anat.pooled else None
        token_norm = anat.token_norm_params(dt)
        blocks = anat.blocks(dt, states.routing)  # a mixture of experts with the forward's routing
        alphas = [a.to(dt) for a in rec.attentions]
        start = _checks.check_int("start_layer", start, low=0, high=len(blocks) - 1)
        if bias == "separate":
            # affine once the coefficients are frozen: one forward + backward gives the carried shares exactly
            xl = x0 if start == 0 else _normal(states.inputs[start].to(dt))
            tok, y = separate_bias_shares(xl, [_normal(a) for a in alphas[start:]], blocks[start:],
                                          positions=pos_t, classes=classes.to(x0.device), pools=pools,
                                          token_norm=token_norm, **head)
            tok = _carried_down(tok, states, alphas, blocks, start, mask, dt)
            return rec, pos, torch.cat([tok, (y - tok.sum(-1)).unsqueeze(-1)], dim=-1)
        if mask is None or pools is not None or bool(mask.all()):
            return rec, pos, _carried(x0, alphas, blocks, pos, classes, head, bias, pools, token_norm)
        return rec, pos, _carried_cropped(x0, alphas, blocks, pos, classes, head, bias, mask)


def _carried_down(tok: torch.Tensor, states, alphas, blocks, start: int, mask, dt) -> torch.Tensor:
    """Shares (B, n) of the tokens entering block ``start`` carried down to the input tokens through the
    blocks below it: s ← s · M_i for i = start − 1, …, 0, M_i measured_rollout's row-normalised matrix
    diag(r) + diag(1 − r) · mean_h α^h (rows sum to 1, so the total, and the bias share, are unchanged)."""
    with torch.no_grad():
        for i in reversed(range(start)):
            x, blk = states.inputs[i].to(dt), blocks[i]
            attn = (states.norm2_in[i] if blk.pre_norm else states.norm1_in[i]).to(dt) - x
            M = normalize_rows(measured_matrix(x, attn, alphas[i], blk), mask)
            tok = torch.einsum("bi,bij->bj", tok, M)
    return tok


def _normal(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it when it was made under ``torch.inference_mode()`` (autograd may not save those)."""
    return t.clone() if t.is_inference() else t


def _check_real(mask: torch.Tensor | None, pos: list[int]) -> None:
    """Refuse explaining a padded position (its logit is no output of the example)."""
    if mask is None:
        return
    bad = [p for b, p in enumerate(pos) if not bool(mask[b, p])]
    if bad:
        raise ValueError(f"position: decompx explains a real (unpadded) token, got padded position(s) {bad}")


def _carried(x0, alphas, blocks, pos, classes, head, bias, pools, token_norm) -> torch.Tensor:
    """The AbsDot route: every token's shares S (B, n, n + 1, d) carried through the blocks (only the explained
    rows in the last block, unless a pooling head reads every row), then the head: (B, n + 1) logit shares."""
    rows = sorted(set(pos))
    with torch.no_grad():
        S = initial_shares(x0)
        for i, blk in enumerate(blocks):
            B, n, K, d = S.shape
            last = i == len(blocks) - 1 and pools is None  # a pooling head reads every row
            R = torch.tensor(rows, device=S.device) if last else None
            chunk = va.chunk_rows(B, K, max(d, mlp_width(blk.mlp)))
            S = block_shares(S, alphas[i], blk, rows=R, bias=bias, chunk=chunk)
        if pools is None:
            idx = torch.tensor([rows.index(p) for p in pos], device=S.device)
            read = S[torch.arange(S.shape[0], device=S.device), idx]  # (B, K, d)
        else:
            read = pool_shares(S, pools, token_norm=token_norm, bias=bias)  # (B, K, G·d)
        return head_shares(read, bias=bias, classes=classes.to(S.device), **head)


def _carried_cropped(x0, alphas, blocks, pos, classes, head, bias, mask) -> torch.Tensor:
    """:func:`_carried` on each padded example's real tokens only, examples with the same real positions
    together. Exact: a real row attends to no padded key (α = 0), so padded tokens' share slots of real rows
    stay 0 through every block (AbsDot gives a zero share no bias), and carrying them only cost time, ~(n /
    n_real)² of it. Padded tokens score 0; (B, n + 1) as :func:`_carried`."""
    B, n, _ = x0.shape
    out = x0.new_zeros(B, n + 1)
    groups: dict[tuple, list[int]] = {}
    for b in range(B):
        groups.setdefault(tuple(mask[b].nonzero().flatten().tolist()), []).append(b)
    for keep, members in groups.items():
        ex, k = torch.tensor(members, device=x0.device), torch.tensor(keep, device=x0.device)
        sub = [a[ex][:, :, k][..., k] for a in alphas]
        kept = [with_rows(blk, lambda w, ex=ex, k=k: w[ex][:, k]) for blk in blocks]  # a mixture's routing
        got = _carried(x0[ex][:, k], sub, kept, [keep.index(pos[b]) for b in members], classes[ex.cpu()],
                       head, bias, None, None)
        out[ex[:, None], torch.cat([k, k.new_tensor([n])])] = got
    return out


@register(
    "decompx",
    description="DecompX: each token's signed share of the target logit, decomposed through attention, norms, MLP and "
                "head (class-specific)",
    options={"bias": "separate", "start_layer": 0, **va.COMMON},
    class_specific=True,
    cost="1 forward + 1 backward (bias='separate', the default; start_layer=l adds l blocks' measured shares); "
         "bias='absdot': + O(n) times the block's linear work (every token's share carried through every block)",
    reference="Modarressi, Fayyaz, Aghazadeh, Yaghoobzadeh & Pilehvar, DecompX: Explaining Transformers "
              "Decisions by Propagating Token Decomposition, ACL 2023",
    refuse=va.REFUSE,
)
def decompx(ctx: Context, *, bias, start_layer, dtype):
    """full_row[b, k] = token k's share of the target logit; ``extra["bias_share"]`` (B,) the rest."""
    rec, pos, out = shares(ctx, bias, dtype, start_layer)
    return ctx.build(rec, out[:, :-1], pos, "self", extra={"bias_share": out[:, -1].detach().float().cpu()})
