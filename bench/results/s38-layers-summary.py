"""One line per layer-wise variant of a bench/gpu.py JSON (session 38's device calls)."""
import json
import sys

text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
keys = ("layerwise_overlap", "layerwise_load_ms", "layerwise_compute_ms", "layerwise_total_ms")
print("default", {k: d.get(k) for k in keys}, "error:", d.get("error_layers"))
print("  timeline", d.get("layerwise_timeline"))
for k, v in d.items():
    if k.startswith("layerwise_variant_"):
        print(k[18:], v.get("error") or {x: v.get(x) for x in keys})
        if v.get("layerwise_timeline"):
            print("  timeline", v["layerwise_timeline"])
