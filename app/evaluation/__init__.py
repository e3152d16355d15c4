"""Quality evaluation of quantized models (perplexity, KL, agreement): sits on top of the
layers and may import anything (app.engine LLM, app.quant)."""
