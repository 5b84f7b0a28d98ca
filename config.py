"""Command-line flags and their conversion into a `ModelConfig`.

train.py defines them at import, eval.py when run as a program; both read FLAGS
in main only, and the graph builder takes the plain config.
"""
import dataclasses
import os

from absl import flags
import tensorflow as tf

from capsnet.data import multimnist
from capsnet.data import tasks
from capsnet.model import fast_conv
from capsnet.model import network
from capsnet.running import cluster_spec
from capsnet.running import runs
from capsnet.running import schedule

DATASETS = sorted(tasks.TASKS)


def default_data_dir(dataset):
  """data/<the task's files>: data/<dataset>; MultiMNIST is made from data/mnist."""
  return f"data/{tasks.get(dataset).files}"

# What a flag adds to its ModelConfig field's description.
_FLAG_ONLY = {"precision": ", or (train.py) auto: the one the planner measures faster "
                           "on this host, recorded in config.json"}


def define_model_flags():
  """One flag per ModelConfig field, default = the paper's value."""
  for field in dataclasses.fields(network.ModelConfig):
    name, default = field.name, field.default
    help_ = field.metadata["help"] + _FLAG_ONLY.get(name, "")
    if isinstance(default, bool):
      flags.DEFINE_bool(name, default, help_)
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, help_)
    elif isinstance(default, float):
      flags.DEFINE_float(name, default, help_)
    elif isinstance(default, tuple):
      flags.DEFINE_list(name, [str(u) for u in default], help_)
    else:
      flags.DEFINE_string(name, default, help_)


def define_train_flags():
  """Model, data and trainer flags (train.py; capsnet.study passes train.py flags through)."""
  define_model_flags()
  define_flags_of(Settings)
  define_cluster_flags()


def define_cluster_flags():
  """Between-graph replication (docs/cluster.md), the cluster's description
  (TF_CONFIG is the alternative); `Settings` has --sync and
  --cluster_wait_secs."""
  flags.DEFINE_list("ps_hosts", [], "cluster: the ps tasks, host:port,...")
  flags.DEFINE_list("worker_hosts", [], "cluster: the workers, host:port,... "
                    "(the first is the chief)")
  flags.DEFINE_enum("job_name", None, ["ps", "worker"], "cluster: this task's job")
  flags.DEFINE_integer("task_index", 0, "cluster: this task's index in its job",
                       lower_bound=0)


def cluster_from_flags(values):
  """The cluster of --ps_hosts/--worker_hosts/--job_name/--task_index, else
  of TF_CONFIG, else None. Raises cluster_spec.ClusterError (a ValueError)."""
  info = cluster_spec.from_flags(values["ps_hosts"].value, values["worker_hosts"].value,
                            values["job_name"].value, values["task_index"].value)
  if info is None and os.environ.get("TF_CONFIG"):
    info = cluster_spec.from_tf_config(os.environ["TF_CONFIG"])
  return info


def model_config_from_flags(values):
  """A ModelConfig from parsed flags; with --dataset=multimnist the image size
  defaults to 36, --precision=auto gives fp32 (train.py's planner may choose
  bf16). Raises ValueError naming the field."""
  kwargs = {}
  if not values["image_size"].present:   # the data set's
    kwargs["image_size"] = tasks.get(values["dataset"].value).image_size
  for field in dataclasses.fields(network.ModelConfig):
    if field.name in kwargs:
      continue
    value = values[field.name].value
    if field.name == "precision":
      value = precision_flag(values)[0]
    if field.name == "decoder_units":
      try:
        value = tuple(int(u) for u in value)
      except ValueError:
        raise ValueError("ModelConfig.decoder_units must be positive ints, "
                         f"got {value!r}") from None
    kwargs[field.name] = value
  return network.ModelConfig(**kwargs)


def default_device():
  """/gpu:0 when TensorFlow sees a GPU, else /cpu:0 (the --device default)."""
  return "/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0"


def resolve_device(device, program):
  """The model's device: --device, or the default; a GPU device on a machine
  where TensorFlow sees none becomes /cpu:0, said in one line."""
  if not device:
    return default_device()
  if fast_conv.on_gpu(device) and not tf.config.list_physical_devices("GPU"):
    print(f"{program}: TensorFlow sees no GPU: the model runs on /cpu:0 instead "
          f"of {device}")
    return "/cpu:0"
  return device


def session_config(devices, log_device_placement=False):
  """The session of a graph placed on `devices`: soft placement, GPU memory
  taken as needed, and as many logical CPU devices as CPU towers."""
  proto = tf.compat.v1.ConfigProto(allow_soft_placement=True,
                                   log_device_placement=log_device_placement)
  proto.gpu_options.allow_growth = True   # take GPU memory as needed, not all
  cpus = sum(d.lower().startswith("/cpu") for d in devices)
  if cpus > 1:   # towers on logical CPU devices
    proto.device_count["CPU"] = cpus
  return proto


def precision_flag(values):
  """(the model config's precision, whether the planner chooses it) from
  --precision: "auto" is fp32 until train.py's planner measures bf16 against
  it (`planner.plan_model`); the one place that reads "auto"."""
  value = values["precision"].value
  return ("fp32", True) if value == "auto" else (value, False)


# --------------------------------------------------------------------------
# The trainer's settings

# What may differ between a run and its resumption: model fields that change
# how the same computation is carried out, not what is computed, and the
# length of the run. Every other model field and recorded setting must match.
MAY_CHANGE_ON_RESUME = ("precision", "conv_impl", "conv_plan", "epochs")
# Recorded settings added since some runs started: what a config.json without
# them means (weight averaging stays off for a run that started without it).
SETTING_DEFAULTS = {"ema_decay": 0.0}

# Trainer settings written to config.json ("train").
RECORDED_SETTINGS = ("dataset", "val_size", "train_size", "batch_size",
                     "learning_rate", "decay_steps", "decay_rate", "seed", "epochs",
                     "multimnist_shift", "workers", "sync", "ema_decay")


_DEFINE = {"bool": flags.DEFINE_bool, "integer": flags.DEFINE_integer,
           "float": flags.DEFINE_float, "string": flags.DEFINE_string,
           "list": flags.DEFINE_list, "enum": flags.DEFINE_enum}


def flag(kind, default, help_, **options):
  """A settings field that is its program's flag of that `kind` (a key of
  _DEFINE), `options` its bounds or enum_values (`define_flags_of`)."""
  return dataclasses.field(default=default, metadata={"flag": (kind, help_, options)})


def define_flags_of(settings_class, flag_values=flags.FLAGS):
  """A flag for each field of `settings_class` made by `flag`: the one list
  of a program's own flags."""
  for field in dataclasses.fields(settings_class):
    if "flag" in field.metadata:
      kind, help_, options = field.metadata["flag"]
      default = [str(v) for v in field.default] if kind == "list" else field.default
      _DEFINE[kind](field.name, default, help=help_, flag_values=flag_values, **options)


DATASET_HELP = ("data set; multimnist: pairs of overlapping MNIST digits (Section 6), "
                "made from the MNIST files")


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The data set's flags, train.py's and eval.py's."""
  dataset: str = flag("enum", tasks.DEFAULT, DATASET_HELP, enum_values=DATASETS)
  data_dir: str = flag("string", None, "folder of the four .gz files "
                       "(default: data/<dataset>; data/mnist for multimnist)")
  download: bool = flag("bool", True, "fetch missing files from public mirrors")


@dataclasses.dataclass(frozen=True)
class Settings(DataSettings):
  """The trainer's flags (all but the model's), read once in `main`: a field
  made by `flag` is its flag; the cluster's description is
  `define_cluster_flags`'."""
  logdir: str = flag("string", "logs/run", "checkpoints, config.json, metrics, events")
  val_size: int = flag("integer", tasks.VAL_SIZE, "validation images held out from the "
                       "end of the training file (0 allowed)", lower_bound=0)
  train_size: int = flag("integer", 0, "use only the first N training images (0: all); "
                         "for quick experiments and tests", lower_bound=0)
  multimnist_shift: int = flag("integer", multimnist.PAIR_SHIFT, "multimnist: largest "
                               "shift of each digit in pixels (the paper: 4; the official "
                               "generator's README: 6)", lower_bound=0, upper_bound=16)
  epochs: int = flag("integer", 50, "training epochs", lower_bound=1)
  max_steps: int = flag("integer", 0, "stop after this many global steps (0: no limit; "
                        "for smoke tests)", lower_bound=0)
  batch_size: int = flag("integer", schedule.BATCH_SIZE, "training batch size (all towers)",
                         lower_bound=1)
  # 200, not 500: the smaller peak memory (docs/training.md has the figures).
  eval_batch_size: int = flag("integer", 200, "batch size for validation/test",
                              lower_bound=1)
  learning_rate: float = flag("float", schedule.LEARNING_RATE, "Adam learning rate",
                              lower_bound=0)
  decay_steps: int = flag("integer", schedule.DECAY_STEPS, "learning-rate decay period "
                          "(steps)", lower_bound=1)
  decay_rate: float = flag("float", schedule.DECAY_RATE, "learning-rate decay factor per "
                           "period", lower_bound=0)
  ema_decay: float = flag("float", 0.0, "weight averaging: decay of an exponential moving "
                          "average of the model variables, scored beside the raw weights "
                          "at every validation (e.g. 0.999; 0: off)", lower_bound=0,
                          upper_bound=0.999999)
  seed: int = flag("integer", 0, "graph-level seed and data order seed")
  device: str = flag("string", None, "model device; default /gpu:0 when TensorFlow sees "
                     "a GPU, else /cpu:0")
  num_gpus: int = flag("integer", 1, "towers on <device type>:0..N-1", lower_bound=1)
  log_device_placement: bool = flag("bool", False, "log where each op runs")
  save_every: int = flag("integer", 1000, "steps between latest checkpoints (also saved "
                         "at each epoch end)", lower_bound=1)
  summary_every: int = flag("integer", 100, "steps between TensorBoard summaries",
                            lower_bound=1)
  diag_every: int = flag("integer", 0, "steps between gradient diagnostics "
                         "(||g_full - g_stop|| / ||g_full||); 0 = off", lower_bound=0)
  val_every: int = flag("integer", 0, "steps between extra validations inside an epoch "
                        "(0: only at epoch ends)", lower_bound=0)
  progress: bool = flag("bool", True, "show a tqdm progress bar")
  adopt_checkpoints: bool = flag("bool", False, "resume the checkpoints of a logdir that "
                                 "has no config.json, with these flags (the variables' "
                                 "shapes are checked against the model)")
  cluster: cluster_spec.ClusterInfo = None   # from the cluster flags; None: one process
  workers: int = 1          # workers training together (1: one process), as
                            # config.json records it; the loop reads the role's
  sync: bool = flag("bool", True, "cluster: synchronous updates (one gradient a worker "
                    "aggregated per step; effective batch = workers x --batch_size); "
                    "false: asynchronous")
  cluster_wait_secs: int = flag("integer", 60, "cluster: how long to wait for the ps "
                                "tasks and for the chief, and how long another worker may "
                                "not answer in synchronous training before the run ends",
                                lower_bound=1)
  replan: bool = flag("bool", False, "measure the convolution plan (and with "
                      "--precision=auto the precision) again; a resumed run keeps its "
                      "recorded plan otherwise")
  keep_epochs: tuple = flag("list", (), "also keep the weights at the end of these "
                            "epochs, every one, in epochs/ of the logdir (e.g. 1,2,5,10)")
  precision_auto: bool = False   # --precision=auto: the planner chooses it

  def recorded(self):
    """The part of the settings that config.json keeps."""
    return {k: getattr(self, k) for k in RECORDED_SETTINGS}

  def check_resume(self, folder, cfg):
    """Raises ValueError naming config.json and the first differing field if the
    run folder's config.json disagrees with `cfg` or these settings (but for
    MAY_CHANGE_ON_RESUME), or it has checkpoints but no config.json (unless
    --adopt_checkpoints). Writes nothing."""
    folder.check_resume(dataclasses.asdict(cfg), self.recorded(),
                        may_change=MAY_CHANGE_ON_RESUME,
                        setting_defaults=SETTING_DEFAULTS, adopt=self.adopt_checkpoints)

  def write_config(self, cfg):
    """config.json: the model config and the recorded settings."""
    runs.RunFolder(self.logdir).write_config(dataclasses.asdict(cfg), self.recorded())

  def task(self):
    """The data set's task (`tasks`)."""
    return tasks.get(self.dataset, self.multimnist_shift)

  def load_splits(self, cfg, task):
    """train/validation/test arrays of the task, checked against `cfg`. Raises
    DataError for missing or corrupt files, ValueError for images or labels the
    model cannot take or a batch over the training split."""
    splits = task.load(self.data_dir, self.val_size, self.download)
    if self.train_size:
      splits["train"] = tuple(a[:self.train_size] for a in splits["train"])
    images, labels = splits["test"][:2]
    expected = (cfg.image_size, cfg.image_size, cfg.image_channels)
    if images.shape[1:] != expected:
      raise ValueError(f"--dataset={self.dataset} has "
                       f"{'x'.join(map(str, images.shape[1:]))} images, the model takes "
                       f"{'x'.join(map(str, expected))} (--image_size, --image_channels)")
    if labels.max() >= cfg.num_classes:
      raise ValueError(f"--dataset={self.dataset} has labels up to {labels.max()}, the "
                       f"model has --num_classes={cfg.num_classes}")
    if len(splits["train"][0]) < self.batch_size:
      raise ValueError(f"--batch_size={self.batch_size} is larger than the "
                       f"{len(splits['train'][0])} training images")
    return splits


def settings_from_flags(values):
  """A `Settings` from parsed flags, device and data defaults resolved. Raises
  ValueError for a batch that does not split over the towers or a cluster
  description that cannot be used."""
  derived = ("cluster", "workers", "precision_auto")
  names = [f.name for f in dataclasses.fields(Settings) if f.name not in derived]
  kwargs = {name: values[name].value for name in names}
  kwargs["cluster"] = cluster_from_flags(values)
  kwargs["workers"] = cluster_spec.num_workers(kwargs["cluster"])
  check_cluster(kwargs["cluster"], kwargs["dataset"], kwargs["ema_decay"],
                values["precision"].value)
  kwargs["keep_epochs"] = parse_epochs(kwargs["keep_epochs"])
  kwargs["precision_auto"] = precision_flag(values)[1]
  kwargs["device"] = resolve_device(kwargs["device"], "train.py")
  kwargs["data_dir"] = kwargs["data_dir"] or default_data_dir(kwargs["dataset"])
  if kwargs["batch_size"] % kwargs["num_gpus"]:
    raise ValueError(f"--batch_size={kwargs['batch_size']} must divide by "
                     f"--num_gpus={kwargs['num_gpus']}")
  return Settings(**kwargs)


def parse_epochs(values):
  """--keep_epochs's values as a sorted tuple of ints.
  Raises: ValueError naming the value, for one that is not a positive integer."""
  try:
    epochs = [int(v) for v in values]
  except ValueError:
    epochs = [0]
  if any(e < 1 for e in epochs):
    raise ValueError(f"--keep_epochs={','.join(values)}: expected positive integers "
                     "(epoch numbers, the first is 1)")
  return tuple(sorted(set(epochs)))


def kept_past_the_end(keep_epochs, epochs):
  """The line train.py says at its start when --keep_epochs names epochs past
  the run's last (nothing is kept for them unless the run is resumed with
  more --epochs), or None."""
  past = [e for e in keep_epochs if e > epochs]
  if not past:
    return None
  return (f"train.py: --keep_epochs: epoch {', '.join(map(str, past))} "
          f"{'is' if len(past) == 1 else 'are'} past the run's last (--epochs={epochs}): "
          "nothing is kept for "
          f"{'it' if len(past) == 1 else 'them'} unless the run is resumed with more epochs")


def check_cluster(cluster, dataset, ema_decay, precision):
  """Raises ValueError naming the flag for what does not run on a cluster (yet),
  where `cluster` is not None."""
  if cluster is None:
    return
  if dataset == "multimnist":
    raise ValueError("--dataset=multimnist does not run on a cluster yet")
  if ema_decay:
    raise ValueError(f"--ema_decay={ema_decay}: weight averaging does not run on a "
                     "cluster yet; use --ema_decay=0 there")
  if precision == "bf16":
    raise ValueError("--precision=bf16 on a cluster: TensorFlow's distributed runtime "
                     "fuses the bfloat16 Conv1 into an op without a bfloat16 CPU "
                     "kernel; use --precision=fp32")


def tower_devices(device, num_towers):
  """['/gpu:0', '/gpu:1', ...] from --device=/gpu:0 and --num_gpus=2."""
  if num_towers == 1:
    return [device]
  kind = device.rsplit(":", 1)[0]
  return [f"{kind}:{i}" for i in range(num_towers)]
