"""The engine core shared by the prefill and decode workers, split the way vLLM v1 splits it:

- `request`: one request's engine-side state; `params`: its validated sampling options;
- `scheduler`: continuous batching and chunked prefill, decides each step (cache-manager calls);
- `executor`: applies a step on one TP rank (cache pages, model forward, page import/export);
- `model_runner`: the model and its forward over a paged batch; `tensor_parallel`: ranks and sharding;
- `output`: sampling, stop conditions and streaming of results;
- `engine`: the loop that ties them together on rank 0 and feeds the other ranks.
"""
