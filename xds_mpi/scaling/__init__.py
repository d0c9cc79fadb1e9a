"""Fast scaling priced on the 910C clock (DeepServe §6, CloudMatrix-Infer §4.4.3):
`steps.scale_out` prices one scale-out event as DeepServe's five steps, `load` its TE-Load per
path, `weights` the bytes each die loads, `validation` the model against CloudMatrix-Infer's
Table 2 (docs/scaling.md)."""
