"""The data: MNIST and Fashion-MNIST files and pipelines (mnist), MultiMNIST
pairs (multimnist), and one task per dataset that the programs choose from
--dataset (tasks)."""
