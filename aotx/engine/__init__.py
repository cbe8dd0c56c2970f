"""The model engine, run inside the device process: llama.cpp through
llama-cpp-python (the only package of aotx that imports ``llama_cpp``).

``llama`` owns a model, its context and batch; ``scheduler`` batches sequences into
decode steps; ``sampling`` builds sampler chains; ``multimodal`` encodes image and
audio through a projector.  Nothing here knows about grants, principals' rights or
HTTP statuses: the device decides those.
"""
