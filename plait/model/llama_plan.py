"""The model plan of plait's Llama (`plait/model/llama.py`), dense and mixture-of-experts blocks.

    attention:    wq, wk, wv split by heads (output rows)  ->  wo split by heads (input columns)
    feed-forward: w1, w3 split by hidden units (rows)      ->  w2 split by hidden units (columns)
    mixture of experts: each expert's w1, w3, w2 so; the router replicated, its gradient a
                  partial sum over tp (each rank's gates meet only its shard of the outputs)
"""

from plait.model.plan import ModelPlan

LLAMA = ModelPlan(
    family="llama",
    blocks="layers",
    hidden_size="dim",
    first=("tok_embeddings",),
    last=("norm", "output"),
    shared=("positions",),
    tp_splits={
        "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
        "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
        "feed_forward.experts.*.w1": 0, "feed_forward.experts.*.w3": 0,
        "feed_forward.experts.*.w2": 1,
    },
    tp_halves=("attention", "feed_forward"),
    tp_divides=("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"),
    tp_partial_grads=("feed_forward.router.weight",),
    vocab_embedding="tok_embeddings",
    vocab_head="output",
    attention_core="attention.core.kernel",
    positions="positions",
    recompute=("attention_norm", "attention.core", "ffn_norm"),
    moe="feed_forward",
)

# The classes of plait's Llama's modules that `parallel.wrap` can name (ZeRO-3's units below a
# block: "Attention,FeedForward,MoEFeedForward"), checked before launch without importing torch;
# the root and its containers are never chosen (`parallel/wrap.py`). tests/unit/test_config.py
# compares them with a built model's.
MODULE_CLASSES = ("Attention", "AttentionCore", "Block", "CausalAttention", "Embedding",
                  "FeedForward", "Linear", "MoEFeedForward", "RootMeanSquareNorm")
