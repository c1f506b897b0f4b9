"""The guard (blockdiag_dist.guard): a layer that mixes along the sequence and is not computed per document is
refused under a step, before it computes; what is computed per document runs; nothing is judged outside a step.
Plain torch modules here; the transformers catalogue is in test_never_silent.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from blockdiag_dist import make_cp_blockdiag_batch_and_ctx, sdpa_routing
from blockdiag_dist.guard import UnsupportedLayerError, check_model, declare_per_document

pytestmark = pytest.mark.usefixtures("one_thread")


def step(S: int = 12, B: int = 1):
    """A CP 1 step over ``B`` rows of two documents, expecting no attention (the modules here have none)."""
    ids = torch.tensor([[1] * (S // 2) + [2] * (S - S // 2)] * B)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.randn(B, S, 4), "_packed_seq_ids": ids},
                                                 expect_attention=False)
    return ctx, batch


class ShortConv(nn.Module):
    """A depthwise causal convolution along the sequence, as hybrid models write it: [B, L, C] -> [B, L, C]."""

    def __init__(self, channels: int = 4, width: int = 3):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class Decay(nn.Module):
    """A gated linear recurrence, recognisable only by its parameter ``A_log``."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(channels))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.cumsum(x * self.A_log.exp(), dim=1)


class Net(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.inp, self.mixer, self.out = nn.Linear(4, 4), mixer, nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.mixer(self.inp(x)))


def test_a_convolution_along_the_rows_is_refused_before_it_runs():
    net = Net(ShortConv())
    ctx, batch = step()
    with pytest.raises(UnsupportedLayerError, match=r"layer 'mixer.conv' \(Conv1d\) is not computed per document under CP: it is a Conv1d along the sequence \(kernel 3 over an input of length 12, this rank's L = 12"):
        with ctx():
            net(batch["inputs_embeds"])
    assert net.mixer.calls == 1 and net.mixer.conv.weight.grad is None  # its parent ran, the convolution did not


def test_a_recurrence_found_by_its_parameter_is_refused_at_the_scan_naming_the_layer():
    net = Net(Decay())
    ctx, batch = step()
    with pytest.raises(UnsupportedLayerError, match=r"layer 'mixer' \(Decay\) is not computed per document under CP: it is a layer holding a state-space.*'A_log'"):
        with ctx():
            net(batch["inputs_embeds"])
    assert net.mixer.calls == 0, "refused at the first call of the model, before the layer computed"
    assert [(f.name, f.kind, f.per_document) for f in check_model(net)] == [("mixer", "recurrent", None)]


@pytest.mark.parametrize("rnn", [nn.LSTM(4, 4, batch_first=True), nn.GRU(4, 4), nn.RNN(4, 4, batch_first=True)],
                         ids=["lstm-batch-first", "gru", "rnn"])
def test_a_recurrent_network_along_the_rows_is_refused(rnn):
    ctx, batch = step(B=2)
    x = batch["inputs_embeds"] if rnn.batch_first else batch["inputs_embeds"].transpose(0, 1)
    with pytest.raises(UnsupportedLayerError, match="recurrent network.*length 12"):
        with ctx():
            rnn(x)


def test_sequence_operators_over_other_lengths_run():
    """A convolution over something that is not this rank's rows (audio frames, channels) is not refused."""
    conv, lstm = nn.Conv1d(4, 4, 3), nn.LSTM(4, 4, batch_first=True)
    ctx, _ = step()
    with ctx():
        conv(torch.randn(1, 4, 40))
        lstm(torch.randn(1, 5, 4))
        nn.Conv1d(4, 4, 1)(torch.randn(1, 4, 12))  # kernel 1: a per-token linear map


def test_a_layer_declared_per_document_runs_and_is_noted():
    mixer = Decay()
    declare_per_document(mixer, "test: one module declared")
    net = Net(mixer)
    ctx, batch = step()
    with ctx():
        net(batch["inputs_embeds"]).sum().backward()
    assert mixer.calls == 1 and any("Decay: computed per document (test: one module declared)" in n for n in ctx.state.notes)
    assert [f.per_document for f in check_model(net)] == ["test: one module declared"]
    # an undeclared twin is still refused
    ctx, batch = step()
    with pytest.raises(UnsupportedLayerError), ctx():
        Net(Decay())(batch["inputs_embeds"])


def test_nothing_is_judged_outside_a_step_and_the_hook_is_removed():
    net = Net(ShortConv())
    net(torch.randn(1, 12, 4))  # no step: the model is the user's, unchanged
    ctx, batch = step()
    with pytest.raises(UnsupportedLayerError), ctx():
        net(batch["inputs_embeds"])
    assert not nn.modules.module._global_forward_pre_hooks, "the guard's hook outlived the step"
    net(torch.randn(1, 12, 4))


def test_expect_attention_false_does_not_let_a_mixer_through():
    """The opt-out of the attention check is for models that do not mix the sequence: a recurrence stays refused."""
    ctx, batch = step()
    with pytest.raises(UnsupportedLayerError), ctx():
        Net(Decay())(batch["inputs_embeds"])


def test_declare_per_document_validates():
    with pytest.raises(ValueError, match="expected a non-empty description"):
        declare_per_document(Decay, "")
    with pytest.raises(ValueError, match="expected an nn.Module class or instance, got int"):
        declare_per_document(3, "x")


def test_the_guard_runs_with_routed_attention_and_checkpointing():
    """A model with attention and no mixer trains as before; a checkpoint recompute passes the guard too."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(4, 12)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 1, 4)).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)

    model = Attn()
    ids = torch.tensor([[1] * 5 + [2] * 7])
    ctx, batch = make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": torch.randn(1, 12, 4), "_packed_seq_ids": ids})
    with ctx(), sdpa_routing():
        torch.utils.checkpoint.checkpoint(model, batch["inputs_embeds"], use_reentrant=False).sum().backward()
    assert ctx.state.attention_calls == 2 and model.qkv.weight.grad is not None
