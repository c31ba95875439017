"""Hugging Face Llama checkpoints (config.json + safetensors) <-> this trainer's model.

    weights.py   parameter names and the RoPE row order, both directions (tied or not)
    folder.py    read and write a save_pretrained folder (sharded safetensors, written a tensor at a time)
    headers.py   what a folder's index and safetensors headers say, checked before a tensor is read
    config_json.py  the type of every config.json field the shapes come from; which files are the folder's
    export.py    a DCP checkpoint -> a folder, streamed: one tensor in memory besides the shard; its
                 host memory peak from the model's shapes (export_host_peak_bytes)
    model_io.py  what the trainer plugs into its checkpoint manager: load a folder into a
                 (sharded) model at start, export a written checkpoint
    __main__.py  python -m trainer.hf import|export

The shapes side (config.json <-> LlamaModelArgs) is trainer/models/llama3/hf_config.py, which
stays free of torch for the launcher's checks. Nothing here is imported by the checkpoint code:
the trainer hands it an object with `load` and `export` (trainer.hf.model_io.HFWeights).
"""
