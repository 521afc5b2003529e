"""The at-scale simulator: the real scheduler, state cache, runner planning and EPLB, timed by a
roofline cost model of GB300 NVL72 / H200 racks.

    rackserve sim validate [--preset gb300]     published DeepSeek-V4.1-Flash figures vs predictions
    rackserve sim run --decode DEP16 --batch 64 --isl 4096 --osl 1024 [--preset h200]
    rackserve sim traces [--traces DIR] [--users 8]  agentic traces: routing and KV-store tiers compared

hardware.py   every machine number with its source, and the global efficiency factors
cost.py       the roofline cost of one gang step (attention, dense, MoE + dispatch/combine, host sync)
experts.py    skewed expert loads and the real EPLB re-placing experts
simulator.py  the step loop over DP ranks with real Scheduler / StateCache (meta device)
scenario.py   one configuration end to end
published.py  the public figures, their wording and assumptions, and the comparison table
agentic.py    the agentic trace workload on simulated prefill instances and a KV store
virtual_time.py  an asyncio loop on a simulated clock (the trace replay's)
"""
