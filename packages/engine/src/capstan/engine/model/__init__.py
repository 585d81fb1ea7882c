"""The model a run trains, as the engine needs it: built from [model] (the reference GPT eager or on
the meta device, transformers models with their init and buffers, a model of one's own sliced;
`models`), the reference GPT's arithmetic (`reference_gpt`), what a model returned (`outputs`), and
this rank's pipeline stage of it (`pipe`).
"""
