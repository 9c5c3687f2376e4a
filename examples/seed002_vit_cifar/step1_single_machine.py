"""Step 1 of the tutorial: a basic single-machine PyTorch example (ViT on CIFAR-10).

    python step1_single_machine.py                      # the tutorial: downloads CIFAR-10 to ~/data
    CIFAR10_ROOT=/tmp/cifar CIFAR10_DOWNLOAD=0 VIT_SIZE=tiny python step1_single_machine.py   # offline

The code is the tutorial's; the settings it hard-codes (lr, epochs, batch size, data root, ViT size)
come from the environment with the tutorial's values as defaults (see cifar.py).
"""

import torch
from cifar import backend_note, env, get_dataloaders, make_vit
from torch import nn
from tqdm import tqdm


def train_func():
    lr = env("LR", 1e-3)
    epochs = env("EPOCHS", 1)
    batch_size = env("GLOBAL_BATCH_SIZE", 512)

    # Get data loaders inside the worker training function.
    train_dataloader, valid_dataloader = get_dataloaders(batch_size=batch_size)

    model = make_vit()  # VisionTransformer(image_size=32, patch_size=4, ..., num_classes=10)

    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    model.to(device)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)

    # Model training loop.
    for epoch in range(epochs):
        model.train()
        for X, y in tqdm(train_dataloader, desc=f"Train Epoch {epoch}"):
            X, y = X.to(device), y.to(device)
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        valid_loss, num_correct, num_total = 0, 0, 0
        with torch.no_grad():
            for X, y in tqdm(valid_dataloader, desc=f"Valid Epoch {epoch}"):
                X, y = X.to(device), y.to(device)
                pred = model(X)
                loss = loss_fn(pred, y)

                valid_loss += loss.item()
                num_total += y.shape[0]
                num_correct += (pred.argmax(1) == y).sum().item()

        valid_loss /= len(train_dataloader)  # (sic) the tutorial divides by the train loader's length
        accuracy = num_correct / num_total

        print({"epoch_num": epoch, "loss": valid_loss, "accuracy": accuracy})


if __name__ == "__main__":
    print(f"step 1: single machine, models and data from {backend_note()}")
    train_func()
