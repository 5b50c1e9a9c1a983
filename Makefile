# Every target creates or reuses the environment in .venv/ first (scripts/setup_env.sh).
VENV   := .venv
PYTHON := $(VENV)/bin/python
NP     ?= 2
# bench-compress's device (cpu, or cuda where PyTorch has it: see gpu-check).
DEVICE ?= cpu
# gpu-check's interpreter: one whose PyTorch has CUDA (Horovod is not needed).
GPU_PYTHON ?= python3

.PHONY: setup test test-slow docs mutation-check demo imagenet-demo bench-compress bench-model-step bench-optimizer-step bench-tf-step gpu-check bench-trace-tf bench-convergence bench-regions bench-scalecom-leader cluster-bench cluster-scaling cluster-negotiation cluster-adaptive cluster-faults traffic-model compose-test horovod-examples stress-hierarchical clean-venv

setup:
	@bash scripts/setup_env.sh

## The default test run (what CI runs): unit and multi-process tests, no slow benchmarks; two
## test processes (pytest-xdist), each taking whole files in collection order (the longest
## first: tests/conftest.py), so one file's multi-process jobs wait on their workers while the
## other's run.
test: setup
	$(PYTHON) -m pytest -m "not slow" -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30

## The documentation site (Sphinx, MyST, furo) into build/docs/html, warnings as errors; make test
## builds it too and checks its internal links (tests/test_docs.py).
docs: setup
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs build/docs/html
	@echo "docs: build/docs/html/index.html"

## Convergence runs and other long checks.
test-slow: setup
	$(PYTHON) -m pytest -m slow -q

## Whether the tests catch the catalogue's plausible bugs, each applied to a copy of the tree (about
## 100 minutes on 2 cores; a C kernel's bug is compiled into the copy): the test that caught each, or the ones none caught, in results/mutation/.
mutation-check: setup
	$(PYTHON) -m benchmarks.mutation

## Time to accuracy on a slow link: 2 workers in 2 network namespaces joined by a 100 Mbit/s
## link (needs root; without it the demo says so and runs on loopback) train the Fashion-MNIST
## CNN dense, then with DGC at density 0.001; per epoch and at the end the test accuracy, the
## seconds of training, the bytes per step and the time each run took to reach dense's final
## accuracy; a plot of accuracy against seconds in build/demo/ (about 3 minutes).
demo: setup
	$(PYTHON) -m benchmarks.demo --out build/demo

## ResNet-50 on a generated 4-class ImageFolder (tiny images, CPU), 3 epochs of DGC with
## checkpoints in build/imagenet-demo/; run it again with EPOCHS=5 to resume from epoch 3.
EPOCHS ?= 3
imagenet-demo: setup
	$(PYTHON) examples/_imagefolder.py build/imagenet-demo/train --classes 4 --images-per-class 32
	TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) --gloo \
		$(PYTHON) examples/pytorch_imagenet_resnet50.py --train-dir build/imagenet-demo/train \
		--image-size 32 --batch-size 4 --steps-per-epoch 3 --epochs $(EPOCHS) --warmup-epochs 1 \
		--base-lr 0.002 --density 0.01 --sparsity-warmup-epochs 1 --loader-workers 0 \
		--checkpoint-dir build/imagenet-demo/checkpoints

## Time the selection of one ResNet-50-sized gradient with each method.
bench-compress: setup
	$(PYTHON) -m benchmarks.compress --device $(DEVICE)

## The engine's CPU time per step on ResNet-50's 161 tensors, every method (a minute or two):
## the fixed cost per tensor that bench-compress's one large gradient does not show. Triton's
## interpreter runs the GPU's Triton kernels in the operation counts (timings take the C kernels).
bench-model-step: setup
	TRITON_INTERPRET=1 $(PYTHON) -m benchmarks.model_step

## One optimizer step of 2 workers on loopback with ResNet-50's gradients in place: Horovod's
## dense all-reduce against dgc on the stock and fused paths (a few minutes).
bench-optimizer-step: setup
	TRITON_INTERPRET=1 TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np 2 -H localhost:2 --gloo \
		$(PYTHON) -m benchmarks.optimizer_step

bench-tf-step: setup
	TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np 2 -H localhost:2 --gloo \
		$(PYTHON) -m benchmarks.tf_step

## On a GPU machine (no .venv, no Horovod): the core and adapter tests on CUDA, bench-compress
## on CUDA and the host synchronisations per step; results in results/gpu/.
gpu-check:
	PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check.sh results/gpu

## Ops and seconds one compressed tensor adds to a TensorFlow graph (the first step's tracing).
bench-trace-tf: setup
	$(PYTHON) -m benchmarks.trace_tf

## Dense vs every method on Fashion-MNIST, 4 workers, 4 epochs (19 runs, hours on 2 cores): final accuracies
## (Markdown), curves (PNG) and wall times in results/convergence/
bench-convergence: setup
	$(PYTHON) -m benchmarks.convergence --np 4

## What the sparse all-reduce's fixed regions hold back on real gradients, against re-balanced
## ones (Fashion-MNIST CNN, 4 workers simulated in one process; minutes): a Markdown table.
bench-regions: setup
	$(PYTHON) -m benchmarks.region_balance

## How well one worker's top-k (ScaleCom's leader's) stands for the top-k of the workers' average,
## at 64 and 256 images per worker (Fashion-MNIST CNN, 4 workers in one process; minutes).
bench-scalecom-leader: setup
	$(PYTHON) -m benchmarks.scalecom_leader

## Training-step benchmark of every method on a 4-host network-namespace cluster at three link
## rates (needs root): results/cluster/ (CSV, Markdown, PNG). QUICK=1: 2 hosts, unshaped and
## 100 Mbit/s, dense and dgc, a few steps (under 5 minutes). INTERLEAVE=1: one launch per link,
## the methods' timed steps alternating (paired medians; benchmarks/cluster/run.py).
cluster-bench: setup
	$(PYTHON) -m benchmarks.cluster.run --check $(if $(QUICK),--quick) $(if $(INTERLEAVE),--interleave)

## Bytes per worker per step as the number of workers grows, from the message layouts
## (ResNet-50, every method and aggregation, N = 2 to 256; seconds): a table and
## docs/img/traffic_model.png.
traffic-model: setup
	$(PYTHON) -m benchmarks.traffic_model

## Bytes per worker per step measured on 2, 4 and 8 network-namespace hosts (ResNet-50,
## batch 2; dgc by allgather and by sparse all-reduce) beside the traffic model (needs root;
## about 10 minutes): results/scaling/scaling.md and scaling.png.
cluster-scaling: setup
	$(PYTHON) -m benchmarks.cluster.scaling

## What Horovod's own negotiation sends while idle, on 2, 4 and 8 network-namespace hosts, at
## HOROVOD_CYCLE_TIME 1, 5 and 25 ms and 0 to 322 collective names (needs root; about 3
## minutes): results/negotiation/negotiation.md.
cluster-negotiation: setup
	$(PYTHON) -m benchmarks.cluster.negotiation

## Faults injected into dgc training on 4 network-namespace hosts (needs root; minutes): a
## stalled rank and a host cut off must end every rank with an error naming the collective
## within 60 s and resume from the last complete checkpoint; a slow link only slows. A delay
## needs the kernel's netem: SLOW_LINK=10mbit where it has none.
## The adaptive switch on a link that slows to 10 Mbit/s and recovers during training, on 2
## network-namespace hosts (needs root; about 2 minutes; not part of make test).
cluster-adaptive: setup
	$(PYTHON) -m benchmarks.cluster.adaptive_link --check --plot docs/img/cluster_adaptive.png

cluster-faults: setup
	$(PYTHON) -m benchmarks.cluster.faults --check $(if $(SLOW_LINK),--slow-link $(SLOW_LINK))

## The Docker Compose cluster, run for real (needs root; minutes; not part of make test): installs
## Debian's docker.io and docker-compose when missing, starts dockerd when none runs, builds the
## image (a debootstrap base when no base image can be pulled), trains dense and dgc on a
## rendezvous + 4 worker containers, unshaped and at 100 Mbit/s, checks and removes everything.
## COMPOSE=v1|v2 picks the compose command; KILL_WORKER=R kills worker R mid-run (must fail).
compose-test: setup
	$(PYTHON) -m benchmarks.compose.compose_test $(if $(COMPOSE),--compose $(COMPOSE)) \
		$(if $(KILL_WORKER),--kill-worker $(KILL_WORKER))

## hierarchical=True's PyTorch and TensorFlow test jobs alternating, again and again, at Gloo's
## default 30 s timeout (a step stalled past it fails the run; docs/guide/many-hosts.md), each line
## stamped, the stacks of a run that never ends dumped (py-spy, which make setup installs). RUNS=20;
## NO_BYTECODE=1 compiles every module from source in every worker.
stress-hierarchical: setup
	$(PYTHON) -m benchmarks.hierarchical_stress --runs $(or $(RUNS),20) $(if $(NO_BYTECODE),--no-bytecode)

## Horovod's own example scripts with only their compression line changed, 2 workers, dgc and
## blocksign (HOROVOD_EXAMPLES: the examples/ folder of a checkout of github.com/horovod/horovod).
horovod-examples: setup
	@test -n "$(HOROVOD_EXAMPLES)" || { echo "set HOROVOD_EXAMPLES=/path/to/horovod/examples"; exit 2; }
	$(PYTHON) -m benchmarks.horovod_examples --horovod-examples $(HOROVOD_EXAMPLES)

clean-venv:
	rm -rf $(VENV)
