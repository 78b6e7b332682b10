"""What exists only for speed, beside the paper's model (``aiayn.model``), which never imports it.

Each module here imports the model and keeps a test (tests/speed/) holding it equal to the plain path:
``incremental`` (the cached decoder step and the inference encoder, and its contract with the model's
layers), ``decoder_cache`` (the decoder's cache, which reorders itself), ``search_steps`` (the beam
search's fewer copies and host reads, and its faster top-k), ``packed`` (linear maps with
weights packed once for oneDNN), ``cpu_attention`` (Eq. 1 on the CPU without SDPA: bf16 training,
few-query decoding), ``dropout`` (the CPU's cheaper dropout masks), ``host_memory`` (freed memory kept
between CPU training steps).
"""
