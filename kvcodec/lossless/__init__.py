"""kvcodec.lossless"""
