"""The trace format names and the shipped traces' short names (no pandas: the config schema and the command
line's help import them)."""

FORMATS = ("azure", "mooncake", "vidur", "burstgpt", "lengths", "native-jsonl", "native-parquet", "native-csv",
           "sharegpt", "vllm-bench", "workload", "inference-perf", "vllm-multi-turn", "csv", "jsonl", "parquet")
# read only when named with format= (a column mapping says which column is what): never detected
GENERIC_FORMATS = ("csv", "jsonl", "parquet")
# formats without arrival times: every request at t=0 unless a rate is given
LENGTH_ONLY_FORMATS = ("lengths", "sharegpt")

DATA_TRACES: dict[str, str] = {
    "azure-conv-2023": "azure2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code-2023": "azure2023/AzureLLMInferenceTrace_code.csv",
    "mooncake-conversation": "mooncake/conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake/synthetic_trace.jsonl",
    "sharegpt-8k-filtered": "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}
# Old short names: still accepted, with a notice naming the new one.
TRACE_ALIASES: dict[str, tuple[str, str]] = {
    "sharegpt": ("sharegpt-8k-filtered", "the trace 'sharegpt' is now 'sharegpt-8k-filtered': Sarathi-Serve's "
                 "8K-filtered ShareGPT conversation lengths (prompt mean 2,340 tokens, output 439), not "
                 "single-round chats; the old name keeps working"),
}



# vLLM's multi-turn benchmark config (benchmarks/multi_turn's generate_multi_turn.json): traces/multi_turn.py
MULTI_TURN_FILETYPE = "generate_conversations"


def is_multi_turn_config(text: str) -> bool:
    return f'"{MULTI_TURN_FILETYPE}"' in text and '"filetype"' in text
