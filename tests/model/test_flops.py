"""pipelines/model/flops.py: the linear layers' FLOPs a forward pass does, the work a reference or check is
credited with."""

from __future__ import annotations

from pipelines.model import flops


def test_a_decoders_linear_flops_are_twice_its_matrix_weights_per_position(tiny_llama):
    """Every position goes through every linear layer once (the tied-free output head included): 2 FLOPs per
    weight per position, whichever shape the batch has."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    per_position = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    with flops.counted(model) as work, torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4, 5]]))  # positional ids
        model(input_ids=torch.tensor([[6, 7], [8, 9]]))  # a batch, by keyword
    assert work.positions == 9 and work.flop == 9 * per_position
    assert work.per_position() == per_position
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]))
    assert work.flop == 9 * per_position  # the hooks went with the block


def test_nothing_run_is_no_work():
    import torch

    with flops.counted(torch.nn.Sequential(torch.nn.Linear(4, 3))) as work:
        pass
    assert work.flop == 0 and work.per_position() == 0.0
