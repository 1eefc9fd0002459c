"""A per-run critic: a linear value head per slot on the last hidden state, GAE advantages and the value loss.

Runs with ``config.advantage.estimator = "gae"`` get one `ValueHeads` slot. The head reads the hidden
state that also feeds the LM head (captured with a forward pre-hook, `capture_hidden`), DETACHED: the
critic is a linear probe of the policy's features, so the value loss never moves the adapter and a
badly scaled reward cannot disturb the policy through the shared trunk. Its parameters join the run's
own optimizer (`slot_parameters`), so they are normalised, clipped and stepped with the run, exported
as ``value_head.safetensors`` and checkpointed with it.

GAE (Schulman et al. 2016), per sample over its loss tokens t = 0..n-1 in order, with ``V_n = 0``:

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}          (A_n = 0)
    R_t     = A_t + V_t                                 (the value target)

``r_t`` is the token's reward: ``token_rewards``, or the sample's scalar ``reward`` on its last
loss-carrying completion token (`trainer_core.packing`). ``V_t`` is the head's value at the position
that predicts token t (the state in which token t was chosen). The value loss is the Huber loss of
``V_t - R_t`` with ``delta = value_clip``: its gradient is the value error clipped to
``[-value_clip, value_clip]``.

Advantages are NOT whitened: whitening needs statistics over the run's whole step, which spans
micro-batches, ranks and packs, and a per-micro-batch statistic would make a run's update depend on
what it was packed with (DESIGN §4.1).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from contracts.durable import follow_umask
from contracts.run_config import RunConfig

__all__ = [
    "VALUE_HEAD_FILE",
    "ValueHeads",
    "capture_hidden",
    "gae_advantages",
    "gae_reference",
    "load_value_head",
    "save_value_head",
    "uses_critic",
    "value_loss",
]


def value_loss(values: Tensor, returns: Tensor, clip: Tensor | float) -> Tensor:
    """(N,) Huber loss of ``values - returns`` with delta ``clip`` (per token or scalar)."""
    err = (values - returns).abs()
    quad = torch.minimum(err, torch.as_tensor(clip, dtype=err.dtype, device=err.device))
    return 0.5 * quad * quad + clip * (err - quad)


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one sample, written out as the textbook recursion (tests and documentation)."""
    out = [0.0] * len(rewards)
    next_value = next_adv = 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[t]
        out[t] = next_adv
    return out


@torch.no_grad()
def gae_advantages(
    *, rewards: Tensor, values: Tensor, sample_ids: Tensor, gamma: Tensor, lam: Tensor, active: Tensor
) -> tuple[Tensor, Tensor]:
    """GAE advantages and value targets (N,) for the ``active`` loss tokens, 0 elsewhere.

    Tokens are in row order, so one sample's tokens are consecutive; each sample's recursion starts
    afresh (V after its last token is 0). ``gamma`` and ``lam`` are per token (the run's). Computed in
    float64 on the host: the recursion is sequential and N is the row's loss tokens.
    """
    adv = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    idx = active.nonzero().squeeze(1)
    if idx.numel() == 0:
        return adv, returns
    r = rewards[idx].double().tolist()
    v = values[idx].double().tolist()
    sid = sample_ids[idx].tolist()
    g = gamma[idx].double().tolist()
    gl = (gamma[idx].double() * lam[idx].double()).tolist()
    out = [0.0] * len(r)
    next_value = next_adv = 0.0
    current = None
    for i in reversed(range(len(r))):
        if sid[i] != current:
            current, next_value, next_adv = sid[i], 0.0, 0.0
        next_adv = r[i] + g[i] * next_value - v[i] + gl[i] * next_adv
        next_value = v[i]
        out[i] = next_adv
    a = torch.tensor(out, dtype=torch.float64, device=values.device)
    adv[idx] = a.to(values.dtype)
    returns[idx] = (a + values[idx].double()).to(values.dtype)
    return adv, returns


class ValueHeads(nn.Module):
    """One linear head ``h -> w . h + b`` per slot (separate parameters, so each run's optimizer owns its own)."""

    def __init__(self, n_slots: int, hidden_size: int) -> None:
        super().__init__()
        self.n_slots = n_slots
        self.hidden_size = hidden_size
        self.weight = nn.ParameterList([nn.Parameter(torch.zeros(hidden_size)) for _ in range(n_slots)])
        self.bias = nn.ParameterList([nn.Parameter(torch.zeros(())) for _ in range(n_slots)])

    def reset_slot(self, slot: int) -> None:
        """Zero the head: a fresh critic predicts 0 (so its first advantages are the rewards-to-go)."""
        with torch.no_grad():
            self.weight[slot].zero_()
            self.bias[slot].zero_()
        self.weight[slot].grad = None
        self.bias[slot].grad = None

    def slot_parameters(self, slot: int) -> list[nn.Parameter]:
        return [self.weight[slot], self.bias[slot]]

    def slot_state_dict(self, slot: int) -> dict[str, Tensor]:
        """The head's tensors as exported in ``value_head.safetensors`` (cloned, on CPU)."""
        return {
            "value_head.weight": self.weight[slot].detach().cpu().clone(),
            "value_head.bias": self.bias[slot].detach().cpu().clone(),
        }

    def load_slot_state_dict(self, slot: int, state: dict[str, Tensor]) -> None:
        expected = {"value_head.weight": (self.hidden_size,), "value_head.bias": ()}
        if set(state) != set(expected):
            raise ValueError(f"value head state has keys {sorted(state)}, expected {sorted(expected)}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(state[name].shape)}, expected {shape}")
        with torch.no_grad():
            self.weight[slot].copy_(state["value_head.weight"])
            self.bias[slot].copy_(state["value_head.bias"])

    def forward(self, hidden: Tensor, token_slots: Tensor, slots: list[int]) -> Tensor:
        """(T,) values of a packed row: ``hidden`` (T, H), detached; tokens of ``slots`` get their slot's
        head, every other token 0."""
        h = hidden.detach().float()
        out = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        for slot in slots:
            sel = (token_slots == slot).nonzero().squeeze(1)
            out = out.index_put((sel,), h.index_select(0, sel) @ self.weight[slot] + self.bias[slot])
        return out


@contextmanager
def capture_hidden(model: nn.Module) -> Iterator[list[Tensor]]:
    """Within the block, every forward of ``model`` appends the input of its output embedding (the
    last hidden state, (batch, L, H)) to the yielded list."""
    seen: list[Tensor] = []
    head = model.get_output_embeddings()  # type: ignore[operator]
    if head is None:
        raise ValueError("the model has no output embedding to read the last hidden state from")

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> None:
        seen.append(args[0])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


VALUE_HEAD_FILE = "value_head.safetensors"
"""The critic's file, written beside a GAE run's PEFT adapter files."""


def save_value_head(heads: ValueHeads, slot: int, directory: Path) -> Path:
    """Write ``slot``'s head to ``directory / value_head.safetensors``."""
    path = Path(directory) / VALUE_HEAD_FILE
    save_file(heads.slot_state_dict(slot), str(path))
    follow_umask(path)  # not safetensors' 0600
    return path


def load_value_head(path: Path) -> dict[str, Tensor]:
    """The tensors of a ``value_head.safetensors`` file (load them with `ValueHeads.load_slot_state_dict`)."""
    return load_file(str(path))


def uses_critic(config: RunConfig) -> bool:
    return config.advantage.estimator == "gae"
