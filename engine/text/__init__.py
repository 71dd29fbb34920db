"""Text in and out: prompt tokenization and chat templates (`tokenization`, shared with the server,
which runs it on its own tokenizer copy) and incremental detokenization with stop strings
(`detokenizer`). Torch-free."""
