"""The small model and RAG-style data of the CacheBlend evaluation (bench/blend.py).

No pretrained weights can be installed here, so the model is a Llama-architecture transformer from
transformers, randomly initialised and then trained for a few hundred steps on synthetic documents
whose next token depends on context: there are TOPICS sparse Markov chains over one shared set of
STATES tokens (so no single token tells the chains apart), every prompt draws one topic, and its
documents are walks on that chain. To predict well the model must infer the topic from what it has
read so far, in its own document and in the others before it: attention that gathers evidence
across documents, unlike a random model's near-uniform attention, which would make blending look
easy. A document's KV computed alone lacks the evidence of the documents before it: exactly the
cross-chunk attention CacheBlend's recompute has to restore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB, BOS, DOC, QUERY, FIRST = 512, 1, 2, 3, 16
STATES, FANOUT, TOPICS = 128, 3, 8
STATE_TOKENS = np.arange(FIRST, FIRST + STATES)


def make_model(layers: int = 8, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float()


@dataclass
class Topic:
    states: np.ndarray  # token ids
    succ: np.ndarray  # (STATES, FANOUT) successor indices
    probs: np.ndarray  # (STATES, FANOUT)

    @classmethod
    def draw(cls, rng: np.random.Generator) -> Topic:
        succ = np.stack([rng.choice(STATES, FANOUT, replace=False) for _ in range(STATES)])
        probs = rng.dirichlet(np.full(FANOUT, 0.3), STATES)
        return cls(STATE_TOKENS, succ, probs)

    @staticmethod
    def all(seed: int = 1234) -> list[Topic]:
        """The fixed topics (the "world" the model is trained on and evaluated in)."""
        rng = np.random.default_rng(seed)
        return [Topic.draw(rng) for _ in range(TOPICS)]

    def walk(self, rng: np.random.Generator, n: int) -> list[int]:
        s = int(rng.integers(STATES))
        cum = np.cumsum(self.probs, axis=1)
        draws = rng.random(n)
        out = []
        for u in draws:
            out.append(int(self.states[s]))
            s = int(self.succ[s, min(int(np.searchsorted(cum[s], u)), FANOUT - 1)])
        return out

    def document(self, rng: np.random.Generator, n: int) -> list[int]:
        return [DOC, *self.walk(rng, n - 1)]


def training_sequence(rng: np.random.Generator, length: int, topics: list[Topic]) -> list[int]:
    topic = topics[int(rng.integers(len(topics)))]
    seq = [BOS]
    while len(seq) < length - 40:
        seq += topic.document(rng, int(rng.integers(48, 257)))
    seq += [QUERY, *topic.walk(rng, 64)]
    return seq[:length]


def train(
    model: torch.nn.Module, steps: int, seq_len: int = 512, batch: int = 6, seed: int = 1, log_every: int = 25
) -> list[tuple[int, float]]:
    """A few hundred AdamW steps; returns (step, loss) points."""
    rng = np.random.default_rng(seed)
    topics = Topic.all()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    curve = []
    started = time.time()
    for step in range(steps):
        x = torch.tensor([training_sequence(rng, seq_len, topics) for _ in range(batch)])
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            curve.append((step, loss.item()))
            print(f"  step {step:4d} loss {loss.item():.3f} ({time.time() - started:.0f}s)", flush=True)
    model.eval()
    return curve


def load_or_train(path: Path, steps: int, layers: int = 8) -> tuple[torch.nn.Module, bool]:
    """The trained model from `path` if it is there, else trained now and saved there."""
    model = make_model(layers)
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval(), False
    train(model, steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.eval(), True
