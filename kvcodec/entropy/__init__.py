"""kvcodec.entropy"""
