"""kvcodec.quant"""
