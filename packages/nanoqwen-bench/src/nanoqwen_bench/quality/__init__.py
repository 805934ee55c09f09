"""Quality of the packed models: held-out perplexity and agreement (`run_quality`), HumanEval pass rate
(`humaneval`), the chat calibration files (`chat_calib`) and the 7B pack time (`pack_time_7b`)."""
