"""The doctor's judgement: pct config GPU entries, driver vs CUDA, sizing, and the helper's own facts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dflash_ops.doctor import checks
from dflash_ops.doctor.checks import FAIL, OK, WARN, Inputs, evaluate
from dflash_ops.doctor.node import NodeFacts, parse_pct_config
from dflash_ops.doctor.plan import GIB, QWEN3_8B, RunPlan, drafter_params, plan_for
from dflash_ops.inventory import Node, Target

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "dflash_ops" / "helpers" / "doctor.py"

NODE = Node(name="pve1", transport="ssh", pct=("pct",), address="10.0.0.1")
TARGET = Target(name="gpu200", node=NODE, ctid=200, base_dir="/opt/dflash", gpus=(0, 1))


def gpu_facts(**over) -> dict:
    """What the helper reports in a healthy 2-GPU container (torch cu130, driver 580)."""
    facts = {
        "python": {"version": "3.12.3", "executable": "/usr/bin/python3"},
        "release": {"deployed": True, "hash": "abc", "venv": "venvs/x", "venv_python": "/opt/dflash/venvs/x/bin/python",
                    "venv_python_exists": True},
        "disk": {"path": "/opt/dflash", "measured_at": "/opt/dflash", "total": 2000 * GIB, "free": 1000 * GIB},
        "shm": {"path": "/dev/shm", "total": 64 * GIB, "free": 64 * GIB, "exists": True, "mounted_here": True,
                "mount": {"point": "/dev/shm", "fstype": "tmpfs", "options": "rw"}},
        "memory": {"MemTotal": 512 * GIB, "MemAvailable": 500 * GIB},
        "limits": {"memlock": {"soft": None, "hard": None}, "nofile": {"soft": 1 << 20, "hard": 1 << 20}},
        "devices": {"nvidia0": "195:0", "nvidia1": "195:1", "nvidiactl": "195:255", "nvidia-uvm": "508:0"},
        "majors": {"nvidia-frontend": 195, "nvidia-uvm": 508},
        "driver": {"proc": "580.65.06", "libcuda": {"version": 13000}},
        "smi": {"gpus": [{"index": i, "name": "NVIDIA H200", "mem_total_mib": 143771, "mem_used_mib": 0,
                          "driver": "580.65.06"} for i in (0, 1)]},
        "runs": {"live": []},
        "model": None,
        "torch": {"python": "/opt/dflash/venvs/x/bin/python", "torch_found": True, "torch": "2.11.0+cu130",
                  "cuda_built": "13.0", "cuda_available": True, "device_count": 2, "visible": "0,1",
                  "devices": [{"index": i, "name": "NVIDIA H200", "total": 140 * GIB, "free": 139 * GIB}
                              for i in (0, 1)],
                  "nccl_version": "2.27.7", "nccl": {"ok": True, "gpus": 2, "mib": 4, "seconds": 0.4}},
    }
    for key, value in over.items():
        facts[key] = value
    return facts


def GPU_CONFIG() -> str:
    return ("arch: amd64\ndev0: /dev/nvidia0\ndev1: /dev/nvidia1\ndev2: /dev/nvidiactl\ndev3: /dev/nvidia-uvm\n"
            "hostname: gpu200\n")


def judge(facts=None, config_text=GPU_CONFIG(), plan=None, **kw) -> dict[str, checks.Check]:
    node = NodeFacts(True, "running", config=parse_pct_config(config_text))
    inputs = Inputs(target=TARGET, plan=plan or RunPlan(gpus=(0, 1)), node=node,
                    facts=gpu_facts() if facts is None else facts, clock=(0.01, 0.05), **kw)
    return {c.name: c for c in evaluate(inputs)}


def test_healthy_gpu_container_passes_every_check():
    result = judge()
    assert {c.status for c in result.values()} == {OK}, [c for c in result.values() if c.status != OK]
    assert "2 × NVIDIA H200" in result["GPUs to torch"].measured
    assert "driver >= 580" in result["driver vs torch CUDA"].needed


def test_pct_config_output_parses_options_and_raw_lxc_keys():
    config = parse_pct_config("arch: amd64\ndev0: /dev/nvidia0,gid=44\nlxc.cgroup2.devices.allow: c 195:* rwm\n"
                              "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n")
    assert config.options["arch"] == "amd64" and config.passthrough_paths() == {"/dev/nvidia0"}
    assert config.bind_mounted() == {"/dev/nvidia-uvm"} and config.allows(195) and not config.allows(508)


def test_missing_gpu_passthrough_suggests_pct_set_with_free_dev_slots():
    result = judge(config_text="arch: amd64\ndev0: /dev/nvidia0\ndev1: /dev/dri/card0\nhostname: gpu200\n")
    check = result["gpu passthrough"]
    assert check.status == FAIL and "missing nvidia1, nvidiactl, nvidia-uvm" in check.measured
    assert check.fix == ("on node pve1: pct set 200 --dev2 /dev/nvidia1 --dev3 /dev/nvidiactl --dev4 /dev/nvidia-uvm"
                         " (then restart the CT)")


def test_bind_mounted_gpus_without_cgroup_allow_name_the_lines_to_add():
    text = "".join(f"lxc.mount.entry: /dev/{n} dev/{n} none bind,optional,create=file\n"
                   for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"))
    text += "lxc.cgroup2.devices.allow: c 195:* rwm\n"
    check = judge(config_text="arch: amd64\n" + text)["gpu passthrough"]
    assert check.status == FAIL and "cgroup allow c 508:* rwm" in check.measured
    assert check.fix == "add to /etc/pve/lxc/200.conf on pve1: lxc.cgroup2.devices.allow: c 508:* rwm"
    fixed = judge(config_text="arch: amd64\n" + text + "lxc.cgroup2.devices.allow: c 508:* rwm\n")
    assert fixed["gpu passthrough"].status == OK


def test_old_driver_for_torch_cuda_fails_with_the_driver_branch_to_install():
    facts = gpu_facts(driver={"proc": "575.57.08", "libcuda": {"version": 12090}},
                      smi={"gpus": [{"index": 0, "name": "H200", "mem_total_mib": 1, "mem_used_mib": 0,
                                     "driver": "575.57.08"}]})
    check = judge(facts)["driver vs torch CUDA"]
    assert check.status == FAIL and check.measured == "driver 575.57.08, supports CUDA 12.9"
    assert check.fix.startswith("install NVIDIA driver >= 580 on node pve1")


def test_gpus_held_by_another_run_fail_a_full_pass_and_warn_in_the_fast_subset():
    facts = gpu_facts(runs={"live": [{"run_id": "big-1", "pid": 7, "gpus": [1, 2]}]})
    full = judge(facts)["GPUs held by runs"]
    assert full.status == FAIL and full.measured == "big-1 holds GPU 1,2" and "run stop gpu200 RUN (big-1)" in full.fix
    assert judge(facts, fast=True)["GPUs held by runs"].status == WARN  # the runs helper refuses atomically


def test_small_shm_disk_ram_and_limits():
    plan = RunPlan(gpus=tuple(range(8)), keep_checkpoints=2, dims=dict(QWEN3_8B), config_path="c.yaml",
                   cuda_indices=tuple(range(8)))
    facts = gpu_facts(shm={"path": "/dev/shm", "total": 64 << 20, "free": 64 << 20},
                      disk={"path": "/opt/dflash", "measured_at": "/", "total": 100 * GIB, "free": 30 * GIB},
                      memory={"MemTotal": 16 * GIB, "MemAvailable": 12 * GIB},
                      limits={"memlock": {"soft": 8 << 20, "hard": 8 << 20}, "nofile": {"soft": 1024, "hard": 4096}})
    facts["torch"]["devices"] = [dict(facts["torch"]["devices"][0], index=i) for i in range(8)]
    result = judge(facts, plan=plan, config_text=GPU_CONFIG().replace("dev3", "dev9") + "".join(
        f"dev{10 + g}: /dev/nvidia{g}\n" for g in range(2, 8)))
    shm = result["/dev/shm"]
    assert shm.status == FAIL and shm.needed == "4.0 GiB free (8 GPU run)"
    assert shm.fix.startswith("in the container: mount -o remount,size=4G /dev/shm; to keep it, add "
                              "`lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=4G,create=dir 0 0`")
    disk = result["disk at base_dir"]
    assert disk.status == FAIL and disk.needed.startswith("3") and "2+1 checkpoints of 11.7 GiB" in disk.needed
    assert result["RAM"].status == FAIL and result["RAM"].fix.startswith("on node pve1: pct set 200 --memory ")
    assert result["memlock limit"].status == WARN and "lxc.prlimit.memlock: unlimited" in result["memlock limit"].fix
    assert result["open files limit"].status == WARN


def test_a_small_disk_only_warns_when_checkpoints_cannot_be_sized():
    facts = gpu_facts(disk={"path": "/opt/dflash", "measured_at": "/", "total": 64 << 20, "free": 60 << 20})
    disk = judge(facts, plan=RunPlan(), config_text="arch: amd64\n")["disk at base_dir"]
    assert disk.status == WARN and disk.needed.startswith("1.0 GiB (pass --config")
    sized = judge(facts, plan=RunPlan(keep_checkpoints=2, dims=dict(QWEN3_8B), config_path="c.yaml"),
                  config_text="arch: amd64\n")["disk at base_dir"]
    assert sized.status == FAIL


def test_cpu_run_on_a_node_without_gpu_passes_and_says_so():
    facts = gpu_facts(devices={}, majors={}, driver={"proc": None, "libcuda": {"error": "no libcuda"}},
                      smi={"error": "nvidia-smi not found"},
                      torch={"python": "python3", "torch_found": True, "torch": "2.11.0+cpu", "cuda_built": None,
                             "cuda_available": False, "device_count": 0, "devices": [], "visible": None})
    result = judge(facts, plan=RunPlan(), config_text="arch: amd64\n")
    assert {c.status for c in result.values()} == {OK}
    assert result["GPUs in container"].measured.startswith("no GPU (nvidia-smi not found)")
    assert result["GPUs in container"].needed == "none (CPU run)"
    gpu_plan = judge(facts, plan=RunPlan(gpus=(0,)), config_text="arch: amd64\n")
    assert gpu_plan["GPUs to torch"].status == FAIL and gpu_plan["torch"].status == FAIL  # a CPU build of torch
    assert gpu_plan["gpu passthrough"].fix.startswith("on node pve1: pct set 200 --dev0 /dev/nvidia0")


def test_clock_offset_beyond_the_measurement_error_warns():
    node = NodeFacts(True, "running", config=parse_pct_config(GPU_CONFIG()))
    skewed = Inputs(TARGET, RunPlan(gpus=(0, 1)), node, gpu_facts(), clock=(42.0, 0.3))
    check = {c.name: c for c in evaluate(skewed)}["clock offset"]
    assert check.status == WARN and check.measured == "+42.00 s (± 0.30 s) vs this machine"
    assert "timedatectl set-ntp true" in check.fix


def test_stopped_container_stops_the_pass_with_pct_start():
    inputs = Inputs(TARGET, RunPlan(gpus=(0, 1)), NodeFacts(True, "stopped", config=parse_pct_config(GPU_CONFIG())))
    result = evaluate(inputs)
    assert [c.name for c in result] == ["container", "gpu passthrough"]
    assert result[0].status == FAIL and result[0].fix == "on node pve1: pct start 200"


def test_checkpoint_estimate_counts_the_drafters_parameters_exactly():
    import torch

    from trainer.models.drafter import DFlashDrafter, DrafterConfig
    from trainer.models.target import QWEN3_8B_DIMS

    assert {k: QWEN3_8B_DIMS[k] for k in QWEN3_8B} == QWEN3_8B
    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = DrafterConfig(**dims, num_hidden_layers=3, vocab_size=100, block_size=8, mask_token_id=1,
                           target_layer_ids=[1, 2], num_target_layers=4)
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    assert drafter_params(dims, 3, 2) == sum(p.numel() for p in drafter.parameters())
    eight_b = RunPlan(dims=dict(QWEN3_8B), drafter_layers=5, num_target_layers=5).checkpoint_bytes()
    assert 12.5e9 < eight_b < 12.7e9  # the 12.6 GB checkpoints of a 5-layer Qwen3-8B drafter


def test_plan_from_the_bundled_configs():
    gpu = plan_for(TARGET, None, REPO / "trainer" / "configs" / "gpu-8b-shape.yaml")
    assert gpu.needs_gpu and gpu.cuda_indices == (0,) and gpu.keep_checkpoints == 2 and gpu.gpu_count == 2
    assert gpu.shm_needed() == GIB and RunPlan(gpus=(0,)).shm_needed() == 64 << 20  # one rank: no NCCL shm
    cpu = plan_for(TARGET, [], REPO / "trainer" / "configs" / "tiny-cpu.yaml")
    assert not cpu.needs_gpu and cpu.shm_needed() == 64 << 20 and cpu.checkpoint_bytes() < 20 << 20


def test_a_config_the_bundled_trainer_rejects_is_a_warning(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("total_steps: 5\n")
    plan = plan_for(TARGET, None, bad)
    assert plan.config_error and str(bad) in plan.config_error and not plan.needs_gpu
    assert judge(plan=plan)["trainer config"].status == WARN


def test_helper_facts_on_this_machine(tmp_path):
    """The helper itself: clock line first, then facts; a missing torch is a fact, not an error."""
    done = subprocess.run([sys.executable, str(HELPER), "facts", "--base", str(tmp_path / "base"), "--python",
                           sys.executable, "--torch", "find", "--shm", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, facts = (json.loads(line) for line in done.stdout.splitlines())
    assert isinstance(first["clock"], float)
    assert facts["disk"]["measured_at"] == str(tmp_path) and facts["disk"]["free"] > 0
    assert facts["shm"]["path"] == str(tmp_path) and facts["release"] == {"deployed": False,
                                                                            "root": str(tmp_path / "base/current")}
    assert facts["torch"]["torch_found"] is True and facts["runs"] == {"error": "no runs helper given"}


def _helper_facts(base: Path, shm: Path) -> dict:
    done = subprocess.run([sys.executable, str(HELPER), "facts", "--base", str(base), "--python", sys.executable,
                           "--torch", "none", "--shm", str(shm)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[1])


def test_a_missing_or_plain_directory_dev_shm_fails(tmp_path):
    """The helper measures the real thing: a missing /dev/shm is not /dev's free space, and a
    directory on the root disk is not a tmpfs (NCCL needs shared memory)."""
    missing = judge(gpu_facts(shm=_helper_facts(tmp_path, tmp_path / "no-shm")["shm"]))["/dev/shm"]
    assert missing.status == FAIL and missing.measured == f"{tmp_path / 'no-shm'} is missing"
    assert missing.fix.startswith("in the container: mkdir -p /dev/shm && mount -t tmpfs -o size=1G tmpfs /dev/shm; "
                                  "to keep it, add `lxc.mount.entry: tmpfs dev/shm")
    plain = judge(gpu_facts(shm=_helper_facts(tmp_path, tmp_path)["shm"]))["/dev/shm"]
    assert plain.status == FAIL and plain.measured.startswith(f"{tmp_path} is not a tmpfs (it is ")
    if Path("/dev/shm").is_dir():
        real = _helper_facts(tmp_path, Path("/dev/shm"))["shm"]
        if real["mount"] and real["mount"]["fstype"] == "tmpfs":
            assert judge(gpu_facts(shm=real), plan=RunPlan(gpus=()))["/dev/shm"].status == OK


def test_an_unwritable_base_dir_fails_with_the_fix():
    facts = gpu_facts(disk={"path": "/opt/dflash", "measured_at": "/opt/dflash", "total": 2000 * GIB,
                            "free": 1000 * GIB, "readonly": True, "writable": False,
                            "write_error": "Read-only file system", "probed": "/opt/dflash"})
    disk = judge(facts)["disk at base_dir"]
    assert disk.status == FAIL and disk.measured == "/opt/dflash: read-only (Read-only file system)"
    assert disk.fix.startswith("in the container: mount -o remount,rw the filesystem holding /opt/dflash")


def test_helper_reads_nvidia_majors(monkeypatch, tmp_path):
    from dflash_ops.helpers import doctor as helper

    fake = tmp_path / "devices"
    fake.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(fake if p == "/proc/devices" else p, *a, **k))
    assert helper.char_majors() == {"nvidia-frontend": 195, "nvidia-uvm": 508}


def test_torch_missing_or_hanging_in_the_venv():
    missing = judge(gpu_facts(torch={"python": "/v/bin/python", "torch_found": False,
                                     "error": "import torch: ModuleNotFoundError: No module named 'torch'"}))
    assert missing["torch"].status == FAIL and "trainer/requirements.txt" in missing["torch"].fix
    assert missing["GPUs to torch"].status == FAIL and missing["NCCL all-reduce"].status == FAIL
    hung = judge(gpu_facts(torch={"python": "/v/bin/python", "error": "timed out after 60s", "timed_out": True}))
    assert hung["torch"].measured == "/v/bin/python: timed out after 60s"
    assert hung["torch"].fix == "look at `dflash-ops exec gpu200 -- /v/bin/python -c 'import torch'`"


def test_the_target_family_is_named_with_its_layer_kinds_and_memory():
    """Qwen3-Next's config.json (as the helper returns it): linear/full layers, MoE, weights in bf16;
    a packed config for a family the trainer cannot pack exactly fails with the reason."""
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 8,
              "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
              "num_experts": 512, "num_experts_per_tok": 10, "vocab_size": 151936,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
              "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    check = judge(gpu_facts(model={"hidden_size": 2048, "config": config}))["target model"]
    assert check.status == OK
    assert "Qwen3-Next" in check.measured and "6 linear" in check.measured and "2 full" in check.measured
    assert "full 3,7; linear 0-2,4-6; MoE 0-7" in check.measured and "512 experts, 10 active" in check.measured
    assert "GiB of weights" in check.needed
    chunked = {**config, "model_type": "llama4_text", "layer_types": ["chunked_attention", "full_attention"] * 4}
    refused = judge(gpu_facts(model={"config": chunked}), plan=RunPlan(gpus=(0, 1), pack_length=4096))
    assert refused["target model"].status == FAIL and "chunked_attention" in refused["target model"].fix



def test_a_quantized_checkpoint_fails_the_target_check_unless_the_trainer_reads_it():
    """An AWQ checkpoint (Qwen3-8B-AWQ's quantization_config) cast as plain weights would train on
    wrong features: refused with the fix; block-scaled FP8 and gpt-oss's MXFP4 are read, and said."""
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
             "vocab_size": 151936}
    awq = {**qwen3, "quantization_config": {"bits": 4, "group_size": 128, "quant_method": "awq"}}
    refused = judge(gpu_facts(model={"config": awq}))["target model"]
    assert refused.status == FAIL and "quantized (awq)" in refused.fix and "bf16 checkpoint" in refused.fix
    assert judge(gpu_facts(model={"config": qwen3}))["target model"].status == OK
    fp8 = {**qwen3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    read_fp8 = judge(gpu_facts(model={"config": fp8}))["target model"]
    assert read_fp8.status == OK and "FP8 weights decoded to the run's dtype at load" in read_fp8.measured
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 24,
               "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
               "intermediate_size": 2880, "num_local_experts": 32, "experts_per_token": 4, "vocab_size": 201088,
               "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
               "quantization_config": {"quant_method": "mxfp4"}}
    read = judge(gpu_facts(model={"config": gpt_oss}))["target model"]
    assert read.status == OK and "MXFP4 experts decoded to the run's dtype at load" in read.measured

def test_the_memory_plan_check_refuses_a_70b_target_with_its_drafter_on_one_h200_and_passes_it_split(tmp_path):
    """doctor (and run start's preflight) size the trainer's memory plan from config.json as read on
    the node and the GPUs' memory as torch measured it: a device that cannot hold its share fails."""
    llama_70b = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    facts = gpu_facts(model={"hidden_size": 8192, "config": llama_70b})

    def check(devices: str) -> checks.Check:
        config = tmp_path / "c.yaml"
        config.write_text("model: {target: {path: /data/models/Llama-3.3-70B}, mask_token_id: 128255, "
                          "drafter_layers: 1}\ndata: {train_path: /data/chat.jsonl, max_length: 4096, "
                          f"token_budget: 4096, bucket_edges: [4096]}}\ndevices: {devices}\n")
        return judge(facts, plan=plan_for(TARGET, None, config))["GPU memory plan"]

    beside = check("{target: [cuda:0], drafter: [cuda:0]}")
    assert beside.status == FAIL and beside.measured.startswith("cuda:0 needs")
    assert "more than its 140.00 GiB budget" in beside.measured
    split = check("{target: [[cuda:0, cuda:1]], drafter: [cuda:1]}")
    assert split.status == OK and "cuda:0" in split.measured and "of 140.0 GiB" in split.measured
    # what training refuses, the doctor refuses: a GPU the container lacks, a split that does not sum
    lacks = check("{target: [[cuda:0, cuda:1]], drafter: [cuda:2]}")
    assert lacks.status == FAIL and lacks.measured == "devices.drafter names cuda:2, but this host has 2 GPUs (cuda:0..cuda:1)"
    uneven = check("{target: [[cuda:0, cuda:1]], target_split: [10, 10], drafter: [cuda:1]}")
    assert uneven.status == FAIL and "devices.target_split: [10, 10] sums to 20 layers; training runs" in uneven.measured
