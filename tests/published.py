"""The parameter counts the Hub publishes for each checkpoint of ``conf/model/`` (its safetensors total, exact):
the planner's counts (tests/test_memory_params.py) and the ``random:`` models (tests/test_random_model.py) are
checked against this one table."""

PUBLISHED = {  # exact parameter counts the Hub publishes for each checkpoint (its safetensors total)
    "Qwen/Qwen2.5-VL-3B-Instruct": 3_754_622_976, "Qwen/Qwen2.5-VL-7B-Instruct": 8_292_166_656,
    "Qwen/Qwen2.5-VL-32B-Instruct": 33_452_718_336, "Qwen/Qwen2.5-VL-72B-Instruct": 73_410_777_344,
    "Qwen/Qwen2-VL-2B-Instruct": 2_208_985_600, "Qwen/Qwen2-VL-7B-Instruct": 8_291_375_616,
    "Qwen/Qwen2-VL-72B-Instruct": 73_405_560_320, "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304, "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen3-VL-2B-Instruct": 2_127_532_032, "Qwen/Qwen3-VL-4B-Instruct": 4_437_815_808,
    "Qwen/Qwen3-VL-8B-Instruct": 8_767_123_696, "Qwen/Qwen3-VL-32B-Instruct": 33_357_390_064,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": 31_070_754_032,
    "OpenGVLab/InternVL3-8B-hf": 7_944_373_760, "OpenGVLab/InternVL3-38B-hf": 38_388_164_992,
    "google/gemma-3-4b-it": 4_300_079_472, "google/gemma-3-12b-it": 12_187_325_040,
    "google/gemma-3-27b-it": 27_432_406_640,
}
