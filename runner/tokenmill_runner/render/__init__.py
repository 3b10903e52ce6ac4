"""From a prompt to the ids SGLang is sent: the model's own tokenizer and chat template (`pretokenize`, with
`tokenizers_compat` for the families' remote code and `content_format` for multi-part content), the tokenizer's
facts recorded with the run (`tokenizer_info`), and whether a request fits the server's limits (`request_fit`).
No text round-trip: what leaves this stage is `input_ids`.
"""
