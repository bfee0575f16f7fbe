"""kvcodec.data"""
