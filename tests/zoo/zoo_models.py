"""The zoo: models as their own libraries build them (random weights, nothing downloaded), with inputs.

Each entry is (name, source, build, input shape); ``build`` returns the model in eval mode with random
weights and randomized BatchNorm statistics. Inputs are small (CI has 2 cores): odd sizes where the
architecture allows, multiples of 32 where it needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fuser.models.common import randomize_batchnorm


@dataclass(frozen=True)
class ZooModel:
    name: str
    source: str  # torchvision, timm, ultralytics, transformers
    task: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    integer_input: int = 0  # > 0: token ids below this

    def build(self) -> nn.Module:
        """The model with the library's random initialization, except that parameters it starts at zero (conv
        biases, a ViT head, LayerNorm shifts) are drawn at random too, as training leaves them: a zero bias is
        not the model's form (torch.onnx's dynamo exporter drops it, and a conv without one fuses differently)."""
        torch.manual_seed(0)
        model = self.make()
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and not p.any():
                    p.normal_(0.0, 0.05)
        return randomize_batchnorm(model, torch.Generator().manual_seed(1)).eval()

    def example_input(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(2)
        if self.integer_input:
            return torch.randint(0, self.integer_input, self.input_shape, generator=g)
        return torch.randn(self.input_shape, generator=g)


def _tv(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kwargs)

    return make


def _tv_detection(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    return _tv(name, weights_backbone=None, **kwargs)


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=48, patch_size=16, num_layers=2, num_heads=3, hidden_dim=48, mlp_dim=96)


def _timm(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return make


def _yolo(cfg: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from ultralytics.nn import tasks

        kind = {"-seg": tasks.SegmentationModel, "-pose": tasks.PoseModel, "-cls": tasks.ClassificationModel}
        cls = next((c for suffix, c in kind.items() if cfg.removesuffix(".yaml").endswith(suffix)), None)
        if cfg.startswith("rtdetr"):
            cls = tasks.RTDETRDetectionModel
        return (cls or tasks.DetectionModel)(cfg, verbose=False)

    return make


class _Tuple(nn.Module):
    """A transformers model returning a tuple (``return_dict=False``), as tracing and pytrees want."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.model(x, return_dict=False)


def _hf(model_cls: str, config_cls: str, **config: object) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        cfg._attn_implementation = "eager"
        return _Tuple(getattr(transformers, model_cls)(cfg))

    return make


_WAV2VEC2 = {
    "conv_dim": (32, 32),
    "conv_stride": (5, 2),
    "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}
_BERT = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 96}

ZOO: list[ZooModel] = [
    # torchvision: classification
    ZooModel("resnet18", "torchvision", "classification", _tv("resnet18"), (2, 3, 45, 39)),
    ZooModel("resnet50", "torchvision", "classification", _tv("resnet50"), (1, 3, 45, 39)),
    ZooModel("mobilenet_v2", "torchvision", "classification", _tv("mobilenet_v2"), (2, 3, 45, 39)),
    ZooModel("mobilenet_v3_small", "torchvision", "classification", _tv("mobilenet_v3_small"), (2, 3, 45, 39)),
    ZooModel("efficientnet_b0", "torchvision", "classification", _tv("efficientnet_b0"), (1, 3, 45, 39)),
    ZooModel("regnet_y_400mf", "torchvision", "classification", _tv("regnet_y_400mf"), (1, 3, 45, 39)),
    ZooModel("shufflenet_v2_x0_5", "torchvision", "classification", _tv("shufflenet_v2_x0_5"), (2, 3, 45, 39)),
    ZooModel("mnasnet0_5", "torchvision", "classification", _tv("mnasnet0_5"), (2, 3, 45, 39)),
    ZooModel("densenet121", "torchvision", "classification", _tv("densenet121"), (1, 3, 45, 39)),
    ZooModel("squeezenet1_1", "torchvision", "classification", _tv("squeezenet1_1"), (2, 3, 45, 39)),
    ZooModel(
        "googlenet",
        "torchvision",
        "classification",
        _tv("googlenet", aux_logits=False, init_weights=True),
        (1, 3, 45, 39),
    ),
    ZooModel("convnext_tiny", "torchvision", "classification", _tv("convnext_tiny"), (1, 3, 45, 39)),
    ZooModel("vit_tiny (torchvision)", "torchvision", "classification", _tv_vit, (2, 3, 48, 48)),
    # torchvision: detection, segmentation
    ZooModel(
        "ssdlite320_mobilenet_v3_large",
        "torchvision",
        "detection",
        _tv_detection("ssdlite320_mobilenet_v3_large"),
        (1, 3, 96, 96),
    ),
    ZooModel(
        "retinanet_resnet50_fpn",
        "torchvision",
        "detection",
        _tv_detection("retinanet_resnet50_fpn", min_size=96, max_size=128),
        (1, 3, 96, 112),
    ),
    ZooModel(
        "fcos_resnet50_fpn",
        "torchvision",
        "detection",
        _tv_detection("fcos_resnet50_fpn", min_size=96, max_size=128),
        (1, 3, 96, 112),
    ),
    ZooModel(
        "deeplabv3_mobilenet_v3_large",
        "torchvision",
        "segmentation",
        _tv_detection("deeplabv3_mobilenet_v3_large", aux_loss=False),
        (1, 3, 65, 63),
    ),
    ZooModel(
        "lraspp_mobilenet_v3_large",
        "torchvision",
        "segmentation",
        _tv_detection("lraspp_mobilenet_v3_large"),
        (1, 3, 65, 63),
    ),
    # timm
    ZooModel("timm resnet18", "timm", "classification", _timm("resnet18"), (2, 3, 45, 39)),
    ZooModel("timm efficientnet_b0", "timm", "classification", _timm("efficientnet_b0"), (1, 3, 45, 39)),
    ZooModel("timm mobilenetv3_small_100", "timm", "classification", _timm("mobilenetv3_small_100"), (2, 3, 45, 39)),
    # TensorFlow's "same" padding computed from the input's size in the forward (Conv2dSame): traced for the
    # example's sizes (fuser.capture.specialize)
    ZooModel(
        "timm tf_mobilenetv3_small_100", "timm", "classification", _timm("tf_mobilenetv3_small_100"), (2, 3, 45, 39)
    ),
    ZooModel("timm cspdarknet53", "timm", "classification", _timm("cspdarknet53"), (1, 3, 64, 64)),
    ZooModel("timm repvgg_a0", "timm", "classification", _timm("repvgg_a0"), (1, 3, 45, 39)),
    ZooModel("timm mobileone_s0", "timm", "classification", _timm("mobileone_s0"), (1, 3, 45, 39)),
    ZooModel("timm densenet121", "timm", "classification", _timm("densenet121"), (1, 3, 45, 39)),
    ZooModel("timm ghostnet_100", "timm", "classification", _timm("ghostnet_100"), (1, 3, 45, 39)),
    ZooModel("timm regnetx_002", "timm", "classification", _timm("regnetx_002"), (2, 3, 45, 39)),
    ZooModel("timm rexnet_100", "timm", "classification", _timm("rexnet_100"), (1, 3, 45, 39)),
    ZooModel("timm dla34", "timm", "classification", _timm("dla34"), (1, 3, 64, 64)),
    ZooModel("timm convnext_atto", "timm", "classification", _timm("convnext_atto"), (1, 3, 45, 39)),
    ZooModel("timm levit_128s", "timm", "classification", _timm("levit_128s", img_size=64), (1, 3, 64, 64)),
    ZooModel(
        "timm vit_tiny_patch16_224",
        "timm",
        "classification",
        _timm("vit_tiny_patch16_224", img_size=48),
        (2, 3, 48, 48),
    ),
    ZooModel(
        "timm deit_tiny_patch16_224",
        "timm",
        "classification",
        _timm("deit_tiny_patch16_224", img_size=48),
        (1, 3, 48, 48),
    ),
    # weights computed in the forward (standardized, NFNet), a fused conv's weight read for its device (EdgeNeXt),
    # a cache filled while traced (EfficientViT), rotary tables computed in every block (EVA-02)
    ZooModel("timm nf_resnet26", "timm", "classification", _timm("nf_resnet26"), (1, 3, 45, 39)),
    ZooModel("timm edgenext_xx_small", "timm", "classification", _timm("edgenext_xx_small"), (1, 3, 64, 64)),
    ZooModel("timm efficientvit_m0", "timm", "classification", _timm("efficientvit_m0", img_size=64), (1, 3, 64, 64)),
    ZooModel(
        "timm eva02_tiny_patch14_224",
        "timm",
        "classification",
        _timm("eva02_tiny_patch14_224", img_size=56),
        (1, 3, 56, 56),
    ),
    # ultralytics
    ZooModel("yolov8n", "ultralytics", "detection", _yolo("yolov8n.yaml"), (1, 3, 64, 96)),
    ZooModel("yolo11n", "ultralytics", "detection", _yolo("yolo11n.yaml"), (1, 3, 64, 96)),
    ZooModel("yolov5nu", "ultralytics", "detection", _yolo("yolov5nu.yaml"), (1, 3, 64, 96)),
    ZooModel("yolov10n", "ultralytics", "detection", _yolo("yolov10n.yaml"), (1, 3, 64, 96)),
    ZooModel("yolov8n-seg", "ultralytics", "segmentation", _yolo("yolov8n-seg.yaml"), (1, 3, 64, 96)),
    ZooModel("yolov8n-pose", "ultralytics", "pose", _yolo("yolov8n-pose.yaml"), (1, 3, 64, 96)),
    ZooModel("yolov8n-cls", "ultralytics", "classification", _yolo("yolov8n-cls.yaml"), (2, 3, 64, 64)),
    # transformers
    ZooModel("bert", "transformers", "text", _hf("BertModel", "BertConfig", **_BERT), (2, 11), integer_input=1000),
    ZooModel(
        "distilbert",
        "transformers",
        "text",
        _hf("DistilBertModel", "DistilBertConfig", dim=48, n_layers=2, n_heads=3, hidden_dim=96),
        (2, 11),
        integer_input=1000,
    ),
    ZooModel(
        "gpt2",
        "transformers",
        "text",
        _hf("GPT2Model", "GPT2Config", n_embd=48, n_layer=2, n_head=3),
        (2, 11),
        integer_input=1000,
    ),
    ZooModel(
        "vit (transformers)",
        "transformers",
        "classification",
        _hf("ViTModel", "ViTConfig", image_size=48, patch_size=16, **_BERT),
        (2, 3, 48, 48),
    ),
    ZooModel(
        "resnet (transformers)",
        "transformers",
        "classification",
        _hf("ResNetModel", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1]),
        (1, 3, 45, 39),
    ),
    ZooModel(
        "wav2vec2 (transformers)",  # its positional conv is a Conv1d under weight_norm
        "transformers",
        "audio",
        _hf("Wav2Vec2Model", "Wav2Vec2Config", **_WAV2VEC2, **_BERT),
        (1, 801),
    ),
    ZooModel(
        "mobilenet_v2 (transformers)",  # tf_padding: "same" padding computed from the input's size, as timm's
        "transformers",
        "classification",
        _hf("MobileNetV2Model", "MobileNetV2Config", depth_multiplier=0.35, image_size=48),
        (2, 3, 45, 39),
    ),
    ZooModel(
        "convnext (transformers)",
        "transformers",
        "classification",
        _hf("ConvNextModel", "ConvNextConfig", hidden_sizes=[16, 24, 32, 48], depths=[1, 1, 1, 1]),
        (1, 3, 45, 39),
    ),
]
