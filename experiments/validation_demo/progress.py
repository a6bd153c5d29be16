"""One picture of a run's validation passes: a row per prompt, a column per pass (each step's own images, from
<run dir>/samples/step-NNNNNNN/prompts.json), scaled up for a page."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scale", type=int, default=2)
    args = parser.parse_args()
    passes = sorted((args.run_dir / "samples").glob("step-*/prompts.json"))
    columns = [json.loads(p.read_text()) for p in passes]
    names = [p["name"] for p in columns[0]["prompts"]]
    first = Image.open(passes[0].parent / columns[0]["prompts"][0]["files"]["model"])
    cell_w, cell_h, label = first.width * args.scale, first.height * args.scale, 14
    sheet = Image.new("RGB", (cell_w * len(columns), (cell_h + label) * len(names) + label), "white")
    pen = ImageDraw.Draw(sheet)
    for c, (index, path) in enumerate(zip(columns, passes, strict=True)):
        pen.text((c * cell_w + 4, 1), f"step {index['step']}", fill="black")
        for r, prompt in enumerate(index["prompts"]):
            image = Image.open(path.parent / prompt["files"]["model"]).resize((cell_w, cell_h), Image.NEAREST)
            top = label + r * (cell_h + label)
            sheet.paste(image, (c * cell_w, top + label))
            if c == 0:
                pen.text((4, top + 1), prompt["prompt"], fill="black")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
