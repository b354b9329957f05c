"""A run directory's layout: the folder of each stage's outputs inside RUN_DIR, and the names of stage 01's two
files that later stages and the lab read. Standard library only: the flag table and the pipeline runner use it."""

# Where each stage's artifacts live inside a run directory.
RUN_LAYOUT = {
    "01_prepare_data": "data",
    "02_extract_hidden_states": "hidden_states",
    "03_build_vocab_mapping": "vocab",
    "04_train": "checkpoints",
    "05_benchmark": "bench",
}
# stage 01's training conversations (eagle3_pipeline/formats/prepared_data.py)
PREPARED_DATA_FILE = "tokenized_data.jsonl"
EVAL_DATA_FILE = "eval_data.jsonl"  # stage 01's held-out conversations, stage 05's default --prompts
