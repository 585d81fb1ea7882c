"""What a model returned, as the engine needs it: the logits, or the loss the model computed itself.

Models of one's own come as they are: a module returning a tensor, a Hugging
Face `ModelOutput` (``CausalLMOutputWithPast`` ...), a dict, or a tuple. A batch
of ``(inputs, targets)`` (capstan's data) calls ``model(inputs)`` and applies
the loss function to the output's logits; a batch that is a dict of tensors
(a Hugging Face-style dataset: ``input_ids``, ``attention_mask``, ``labels``)
calls ``model(**batch)`` and uses the loss the model returned when it
computed one (it got labels), else the loss function on the logits and
``batch["labels"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from capstan.comm.log import get_logger, warn_once

__all__ = ["check_batch_convention", "logits_of", "loss_of"]

log = get_logger(__name__)


def logits_of(out: object) -> torch.Tensor:
    """The tensor a loss function wants from a model's output (see the module docstring)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)  # a ModelOutput (also a dict) or any object with .logits
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if logits is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned {type(out).__name__} without logits: return a tensor, a Hugging Face "
                        "ModelOutput or dict with 'logits', or a tuple whose first element is the logits")
    return logits


def loss_of(model: Callable[..., object], batch: object, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            ) -> torch.Tensor:
    """The mean loss of one micro-batch, in fp32: `batch` is (inputs, targets) or a dict of tensors."""
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None) if not isinstance(out, Mapping) else out.get("loss")
        if loss is not None:
            return loss.float()
        if "labels" not in batch:
            raise ValueError("a dict batch needs 'labels' (or a model that returns its own loss)")
        return loss_fn(logits_of(out).float(), batch["labels"])
    x, y = batch  # type: ignore[misc]
    # The loss in fp32: a 16-bit softmax over the vocabulary loses the small probabilities.
    return loss_fn(logits_of(model(x)).float(), y)


def check_batch_convention(batch: object, pipelined: bool) -> None:
    """What a first micro-batch tells about how it was made (the engine checks one, before any work).

    A tuple batch is (inputs, next-token targets): targets already shifted. A dict batch is the model's
    own keywords, `labels` shifted by the model (Hugging Face). A tuple whose targets equal its inputs is
    almost certainly the Hugging Face convention (labels = input_ids) passed as a tuple: the model would
    learn to copy its input, so say so once. A pipeline takes tuple batches only (its stages pass
    activations, not keywords): a dict there is refused on every rank, each of which reads the batch."""
    if isinstance(batch, Mapping):
        if pipelined:
            keys = ", ".join(sorted(map(str, batch)))
            raise ValueError(f"parallel.pp > 1 takes (inputs, next-token targets) tuple batches, got a dict batch "
                             f"({keys}); pass (ids[:, :-1], ids[:, 1:]) for a causal LM, or run at pp = 1, where "
                             "dict batches go to the model as keywords")
        return
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y):
            warn_once(log, "a tuple batch's targets equal its inputs: a tuple is (inputs, next-token targets), "
                           "already shifted; Hugging Face's labels = input_ids (shifted by the model) go in a dict "
                           "batch {'input_ids': ..., 'labels': ...}, or pass (ids[:, :-1], ids[:, 1:])")
